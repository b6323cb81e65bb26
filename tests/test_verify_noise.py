"""verify's AdamW bound (train/verify_noise.py): a configuration whose AdamW eps magnifies rounding
(configs/gpt-small.toml's optimizer: eps 1e-8, lr 2e-3) passes at tp 2 on the bound derived from the
optimizer's arithmetic, while faults still fail (in the gradients, on the strict bars at every step;
in the optimizer, beyond the element-wise bound), and both verdicts hold with the reference's
rounding perturbed. That verify's own small model keeps the strict bars (no bound without --config)
is checked by tests/test_cli.py's verify run.
"""

from __future__ import annotations

from shardlab.train.config import load_config
from shardlab.train.verify import VERIFY_BASE

# gpt-small's optimizer (eps 1e-8: what magnifies rounding) on verify's small GPT, 4 steps.
GPT_SMALL_OPTIM = ["optim.eps=1e-8", "optim.lr=2e-3", "optim.min_lr=2e-4", "optim.weight_decay=0.1",
                   "optim.grad_clip=1.0", "train.steps=3"]


def _cfg(*extra: str) -> dict:
    cfg = load_config(None, ['model.name="gpt"', "layout.tp=2", *extra], base=VERIFY_BASE)
    cfg.validate()
    return cfg.to_dict()


def _faulty(cfg_dict: dict) -> dict | None:
    """verify_rank (AdamW bound on) with a fault on rank 1's gradient of one column-parallel weight:
    scaled by 1 + 1e-3 at the first step, then zero (a reduction that never arrived) from the second."""
    import torch.distributed as dist

    import shardlab.train.verify as verify

    original = verify.parallelize
    calls = [0]

    def hook(g):  # noqa: ANN001, ANN202
        calls[0] += 1
        return g * (1 + 1e-3) if calls[0] == 1 else g * 0

    def faulty(model, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        out = original(model, *args, **kwargs)
        if dist.get_rank() == 1:
            next(p for n, p in out.named_parameters() if n.endswith("blocks.0.mlp.fc.weight")).register_hook(hook)
        return out

    verify.parallelize = faulty
    try:
        return verify.verify_rank(cfg_dict, 1e-6, 1e-5, 1e-7, 2.0, True)
    finally:
        verify.parallelize = original


def _no_decay_on_rank1(cfg_dict: dict, **perturb: float) -> dict | None:
    """verify_rank (AdamW bound on) where rank 1's layout optimizer lost its weight decay (an
    optimizer fault the gradients never show: every step its shards decay lr x 0.1 x p too little,
    about 4e-6 absolute per step on a weight of scale 0.02)."""
    import copy

    import torch.distributed as dist

    import shardlab.train.verify as verify

    original = verify.make_optimizer
    calls = [0]

    def faulty(model, o, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        calls[0] += 1
        if calls[0] == 1 and dist.get_rank() == 1:  # the layout's (the reference's is built second)
            o = copy.deepcopy(o)
            o.weight_decay = 0.0
        return original(model, o, *args, **kwargs)

    verify.make_optimizer = faulty
    try:
        return verify.verify_rank(cfg_dict, 1e-6, 1e-5, 1e-7, 2.0, True, **perturb)
    finally:
        verify.make_optimizer = original


def _needed(report: dict) -> list[str]:
    """Parameters with elements above their strict bar (passing only on the AdamW bound)."""
    return [n for n, b in report["noise_floor"]["parameters"].items() if b["above_strict"]]


def test_eps_1e8_passes_on_the_adamw_bound_and_faults_still_fail(pools):
    from shardlab.train.verify import verify_rank

    cfg = _cfg(*GPT_SMALL_OPTIM)
    report = pools(2).run(verify_rank, cfg, 1e-6, 1e-5, 1e-7, 2.0, True)[0]
    assert report["passed"], report["per_step"]
    nf = report["noise_floor"]
    assert nf["measured"] and nf["kind"] == "adamw bound" and nf["anchored"]
    # Loss and gradient norm keep the strict bars at every step (each starts from the layout's own
    # parameters); the gradients at the first, and later their term-mass bound, no sample.
    for r in report["per_step"]:
        assert r["grad_allowance_used"] <= 1 and r["grad_norm_allowance_used"] <= 1
        assert abs(r["loss_diff"]) <= 1e-6 * abs(r["ref_loss"])
    assert [r["anchored"] for r in report["per_step"]] == [False, True, True]
    assert report["per_step"][0]["grad_floor_rel"] == 0 and nf["chain"] > 384  # more than the batch's tokens

    faulty = pools(2).run(_faulty, cfg)[0]
    assert not faulty["passed"]
    first, second = faulty["per_step"][:2]
    # Step 1, gradients 1e-3 off in one shard: caught on the strict gradient bar.
    assert not first["passed"] and first["grad_allowance_used"] > 1 and first["worst_grad"] == "blocks.0.mlp.fc.weight"
    # Step 2, that shard's gradient lost: far beyond the gradient bar (strict or term mass).
    assert not second["passed"] and second["grad_allowance_used"] > 10, second


def test_verdicts_hold_with_the_references_rounding_perturbed(pools):
    """What another CPU or thread count changes is the rounding of the reference's sums: here the
    reference sums each batch over 2 micro-batches and every nonzero gradient element moves by 4 fp32
    units of its tensor's scale (sign at random). The correct layout still passes (the bound follows
    the gradients' actual differences, which AdamW then magnifies: some elements land above their
    strict bar), and an optimizer fault (weight decay lost on one rank) still fails."""
    from shardlab.train.verify import verify_rank

    cfg = _cfg(*GPT_SMALL_OPTIM, "train.steps=2")  # step 2: the first from the layout's own parameters
    perturb = {"ref_micro_batches": 2, "ref_noise_ulps": 4.0}
    report = pools(2).run(verify_rank, cfg, 1e-6, 1e-5, 1e-7, 2.0, True, **perturb)[0]
    assert report["passed"], report["per_step"]
    assert _needed(report), report["noise_floor"]
    assert max(r["grad_allowance_used"] for r in report["per_step"]) <= 1

    faulty = pools(2).run(_no_decay_on_rank1, cfg, **perturb)[0]
    assert not faulty["passed"]
    # Gradients are the same at step 1 (same weights, nothing decayed yet); the parameters are not.
    first = faulty["per_step"][0]
    assert first["grad_allowance_used"] <= 1 and first["param_allowance_used"] > 5, first


def test_adamw_bound_holds_element_by_element_against_torchs_adamw():
    """The bound's arithmetic against torch's AdamW itself: two copies of the same parameters step
    with gradients that differ by up to 64 ulps of their scale (larger than a reordering's), many of
    them near zero where eps 1e-8 magnifies; each step starts both from the same weights, as verify
    does. Every element lands within the bound, many of them far above the strict bar; and the
    bound is not vacuous: it is far below the largest update for elements whose gradient is large."""
    import torch

    from shardlab.train.verify_noise import AdamBound, largest_update

    torch.manual_seed(0)
    n, lr = 4096, 2e-3
    base = torch.randn(n) * 0.02
    grads = torch.randn(6, n) * torch.logspace(-10, -2, n)  # magnitudes from 1e-10 to 1e-2
    ref, lay = torch.nn.Linear(1, n, bias=False), torch.nn.Linear(1, n, bias=False)
    ref.weight.data[:, 0], lay.weight.data[:, 0] = base, base
    opts = [torch.optim.AdamW(m.parameters(), lr=lr, eps=1e-8, weight_decay=0.1) for m in (ref, lay)]
    bound, above = AdamBound(), 0
    for step in range(6):
        lay.weight.data.copy_(ref.weight.data)  # the same weights at every step's start
        g_r = grads[step]
        g_l = g_r + torch.randint(-64, 65, (n,)) * (torch.finfo(torch.float32).eps / 2) * g_r.abs().max()
        for m, g in ((ref, g_r), (lay, g_l)):
            m.weight.grad = g.reshape(n, 1).clone()
        for o in opts:
            o.step()
        allowed = bound.allowances(ref, opts[0], {"weight": ref.weight.grad}, {"weight": lay.weight.grad})["weight"]
        d = (lay.weight.data.double() - ref.weight.data.double()).abs()
        strict = 1e-7 + 1e-6 * ref.weight.data.abs().max().item()
        assert (d <= strict + allowed.reshape(d.shape)).all(), (d / (strict + allowed.reshape(d.shape))).max()
        above += int((d > strict).sum())
        big = g_r.abs() > 1e-3
        assert (allowed.reshape(-1)[big] < 1e-3 * largest_update(lr, 0.9, 0.999, step + 1)).all()
    assert above > 100


def test_term_mass_of_a_linear_is_the_sum_of_its_absolute_per_token_terms():
    import torch

    from shardlab.train.verify_terms import TermMass

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.LayerNorm(4))
    x = torch.randn(3, 5, 8)
    terms = TermMass(model)
    terms.enabled = True
    model(x).sin().sum().backward()
    lin = model[0]
    h = lin(x).detach()
    d = torch.autograd.functional.vjp(lambda y: model[1](y).sin().sum(), h)[1]  # dL/d(linear output)
    per_token = d.reshape(-1, 4)[:, :, None] * x.reshape(-1, 8)[:, None, :]
    assert torch.allclose(terms.mass["0.weight"], per_token.abs().sum(0), rtol=1e-5)
    assert torch.allclose(terms.mass["0.bias"], d.reshape(-1, 4).abs().sum(0), rtol=1e-5)
    assert (lin.weight.grad.abs() <= terms.mass["0.weight"] * (1 + 1e-5)).all()
    assert set(terms.mass) == {"0.weight", "0.bias", "1.weight", "1.bias"}
