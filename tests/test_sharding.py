"""Declarative sharding (issue 19): rules refused before launch with the module, tensor and axis named;
the derived collectives against the hand-written tensor parallelism's, collective by collective; verify
against one process for the rules of Megatron TP, TP+SP, FSDP and a combination; and a randomized test
over rules and meshes of 2 and 4 ranks, refusals included, whose refusals are predicted independently."""

from __future__ import annotations

import json
import random
from collections import Counter

import pytest

from shardlab.models.gpt import GPT, GPTConfig
from shardlab.models.mlp import DeepMLP, MLPConfig
from shardlab.parallel.sharding import Rules, ShardingError, derive
from shardlab.train.config import ConfigError, load_config
from shardlab.train.verify import VERIFY_BASE

MEGATRON = "heads=tp, mlp=tp, vocab=tp"


def _gpt(**kw) -> GPT:  # noqa: ANN003
    return GPT(GPTConfig(**{**dict(vocab_size=64, seq_len=16, n_layer=2, n_head=4, d_model=32), **kw}))


def _refusal(model, compute: str, sizes: dict, params: str = "") -> str:  # noqa: ANN001
    with pytest.raises(ShardingError) as err:
        derive(model, Rules.parse(compute, params), sizes, rows=2)
    return str(err.value)


def test_refusals_name_module_tensor_and_axis():
    twice = _refusal(DeepMLP(MLPConfig(d_model=16, n_layer=2)), "embed=tp, mlp=tp", {"tp": 2})
    assert "parameter layers.0.weight (mlp/tp, embed/tp): mesh axis 'tp' used twice" in twice
    divides = _refusal(_gpt(n_head=4, n_kv_head=2), "heads=tp, mlp=tp", {"tp": 4})
    assert "blocks.*.attn: 2 key/value heads cannot be cut into tp = 4" in divides
    assert "blocks.*.attn.kv.weight: dim 0 (kv_heads) has 16 elements per block, which tp = 4 does not divide" not in divides
    partial = _refusal(_gpt(), "embed=tp", {"tp": 2})
    assert "blocks.*.ln1 normalises the residual (batch, seq, embed) over embed" in partial and "partial sum" in partial
    assert "ring attention" in _refusal(_gpt(), "ctx=tp", {"tp": 2})
    assert "'pp'" in _refusal(_gpt(), "heads=pp", {"tp": 2})
    assert "unknown logical axis 'hidden'" in _refusal(_gpt(), "hidden=tp", {"tp": 2})
    seq = _refusal(_gpt(seq_len=18), "seq=tp", {"tp": 4})
    assert "seq_len 18 does not divide by tp = 4" in seq
    # Context parallelism: the zigzag split needs 2 x cp chunks; sp cuts a cp rank's tokens further.
    assert "tokens: activation residual (batch, seq/cp, embed): seq_len 18 does not divide by 2 x cp = 4" in \
        _refusal(_gpt(seq_len=18), "seq=cp", {"cp": 2})
    assert "seq_len 24 / cp 4 = 6 tokens per cp rank do not divide by tp = 4" in \
        _refusal(_gpt(seq_len=24), "seq=cp+tp", {"cp": 4, "tp": 4})
    assert "heads='cp': only the sequence (seq) is cut over 'cp'" in _refusal(_gpt(), "heads=cp", {"cp": 2})
    assert "the deep MLP has no sequence" in _refusal(DeepMLP(MLPConfig(d_model=16, n_layer=2)), "seq=cp", {"cp": 2})
    derive(_gpt(dropout=0.1), Rules.parse("seq=cp"), {"cp": 2}, rows=2)  # the ring drops too (models/dropout.py)
    assert "'tp+cp'" in _refusal(_gpt(), "seq=tp+cp", {"cp": 2, "tp": 2})
    cfg = load_config(None, ["layout.cp=2", f"sharding.compute={MEGATRON}"], base=VERIFY_BASE)
    with pytest.raises(ConfigError, match="layout.cp = 2 with .sharding. rules that keep seq off cp"):
        cfg.validate()
    # Before launch: validate() derives the plan on the meta device.
    cfg = load_config(None, ["layout.tp=2", "sharding.compute=embed=tp"], base=VERIFY_BASE)
    with pytest.raises(ConfigError, match="partial sum fed where it cannot be"):
        cfg.validate()
    cfg = load_config(None, ["layout.tp=2", "layout.sp=true", f"sharding.compute={MEGATRON}"], base=VERIFY_BASE)
    with pytest.raises(ConfigError, match="the rules replace both"):
        cfg.validate()


def test_config_section_takes_text_and_inline_tables():
    a = load_config(None, ['sharding.compute={heads = "tp", mlp = "tp"}'])
    b = load_config(None, ["sharding.compute=heads=tp, mlp=tp"])
    assert a.sharding.compute == b.sharding.compute == "heads=tp, mlp=tp"
    assert Rules.parse(a.sharding.compute).compute == {"heads": "tp", "mlp": "tp", "kv_heads": "tp"}
    assert "[sharding]" in a.to_toml() and 'compute = "heads=tp, mlp=tp"' in a.to_toml()


def test_plan_places_megatron_and_sequence_parallel_collectives():
    plan = derive(_gpt(), Rules.parse(MEGATRON + ", seq=tp"), {"dp": 2, "tp": 2}, rows=2)
    attn, proj = plan.module("blocks.0.attn"), plan.module("blocks.0.attn.proj")
    assert [(c.fn, c.fwd, c.bwd) for c in attn.entry] == [("gather_from_sequence", "all_gather", "reduce_scatter")]
    assert [(c.fn, c.dim) for c in proj.exit] == [("reduce_scatter_to_sequence", 1)] and proj.partial_out
    assert attn.inp == "(batch/dp, seq/tp, embed)" and proj.inp == "(batch/dp, ctx, heads/tp)"
    assert plan.module("blocks.0.ln1").weight_sync and plan.data[0].bwd == "all_reduce"
    fsdp = derive(_gpt(), Rules.parse(MEGATRON, "embed=dp"), {"dp": 2, "tp": 2}, rows=2)
    assert fsdp.fsdp and [c.bwd for c in fsdp.data] == ["all_gather", "reduce_scatter"]
    # seq over cp (with sp over tp): every module on t / cp tokens, a ring per attention core, the loss
    # averaged over cp, the replicated weights' gradients over dp x cp.
    plan = derive(_gpt(), Rules.parse(MEGATRON + ", seq=cp+tp"), {"dp": 2, "cp": 2, "tp": 2}, rows=2)
    core = plan.module("blocks.0.attn.attend")
    kv, grad = core.entry[0], core.exit[0]
    block = 2 * 2 * (4 // 2) * (16 // 2) * 8   # k and v x rows x kv heads over tp x tokens over cp x head_dim
    assert (kv.fn, kv.axis, kv.nbytes, kv.bytes_fwd(), kv.bytes_bwd()) == ("ring_kv", "cp", block * 4, block * 4, block * 4)
    assert (grad.fn, grad.bytes_fwd(), grad.bytes_bwd(), grad.calls("bwd")) == ("ring_kv_grad", 0, 2 * block * 4, 2)
    assert plan.module("blocks.0.attn").inp == "(batch/dp, seq/cp+tp, embed)"
    assert plan.module("blocks.0.attn.proj").entry == [] and plan.module("blocks.0.attn.proj").inp == \
        "(batch/dp, ctx/cp, heads/tp)"
    assert plan.module("blocks.0.attn").entry[0].nbytes == 2 * (16 // 2) * 32 * 4   # sp's gather of t / cp tokens
    assert [c.fn for c in plan.module("loss").exit] == ["whole_loss"] and plan.context_axis == "cp"
    assert plan.data[0].axis == "dp+cp" and plan.counts(axis="cp")["sendrecv"]["calls"] == 2 * (1 + 1 + 2)


# ------------------------------------------------------------------------------ trace equality
_REPLICATED_VOCAB = {"tok_emb": "replicate", "pos_emb": "replicate", "blocks.*.ln1": "replicate",
                     "blocks.*.attn": "heads", "blocks.*.ln2": "replicate", "blocks.*.mlp.fc": "column",
                     "blocks.*.mlp.proj": "row", "ln_f": "replicate", "head": "replicate"}


def test_derived_collectives_equal_hand_written(pools):
    """Collective by collective (operation and bytes) over tp 2, one forward and backward. The deep MLP
    and the GPT's blocks match exactly; where the forms differ, the differences are the ones the
    derivation documents (docs/sharding.md) and nothing else."""
    from sharding_ranks import traces

    pool = pools(2)
    rows, t, d, vocab, layers = 3, 16, 32, 64, 2  # 3 rows: no per-token sum is the size of a norm
    resid, logits, pos = rows * t * d * 4, rows * t * vocab * 4, t * d * 4
    for kind, plan, sp, rules in (("mlp", None, False, "mlp=tp"), ("gpt", _REPLICATED_VOCAB, False, "heads=tp, mlp=tp")):
        got = pool.run(traces, kind, plan, sp, rules, rows)[0]
        assert got["hand"] == got["derived"], json.dumps(got)
        assert got["hand"] and got["same_record"]
    # Megatron TP with the vocabulary cut: the same ten residual all-reduces; the loss differs. Megatron's
    # vocabulary-parallel cross-entropy all-reduces per-token statistics, the derived plan gathers the
    # logits for the model's own (replicated) loss.
    got = pool.run(traces, "gpt", None, False, MEGATRON, rows)[0]
    assert got["same_record"]
    hand, derived = Counter(map(tuple, got["hand"])), Counter(map(tuple, got["derived"]))
    assert derived - hand == Counter({("all_gather", logits): 1})
    assert hand[("all_reduce", resid)] == derived[("all_reduce", resid)] == 2 + 4 * layers
    assert all(op == "all_reduce" and b <= rows * t * 8 for op, b in (hand - derived).elements())
    # TP + SP: the same reduce-scatters and forward all-gathers. Hand-written Megatron SP gathers each
    # region's input again in backward (memory for time; 4 regions + the head), sums the norms' gradients
    # in one flat all-reduce and the position table's gradient by an all-reduce; the plan keeps the
    # gathered input, reduces each norm weight where it is used, and gathers the positions' gradient.
    got = pool.run(traces, "gpt", None, True, MEGATRON + ", seq=tp", rows)[0]
    assert got["same_record"]
    hand, derived = Counter(map(tuple, got["hand"])), Counter(map(tuple, got["derived"]))
    assert hand[("reduce_scatter", resid)] == derived[("reduce_scatter", resid)] == 1 + 4 * layers + 1
    assert hand[("all_gather", resid)] - derived[("all_gather", resid)] == 2 * layers + 1
    norms = (2 * layers + 1) * 2
    assert derived - hand == Counter({("all_reduce", d * 4): norms, ("all_gather", pos): 1, ("all_gather", logits): 1})
    extra = hand - derived
    assert extra[("all_gather", resid)] == 2 * layers + 1, extra
    # Hand-written: the norms' (and positions') gradients in one flat all-reduce per block and one at the
    # end, the same bytes as the derived per-weight all-reduces; the rest is the loss's per-token sums.
    flat = [b for op, b in extra.elements() if op == "all_reduce" and b > rows * t * 8]
    assert len(flat) == layers + 1 and sum(flat) == norms * d * 4 + pos, extra
    assert sum(extra.values()) == 2 * layers + 1 + layers + 1 + 2, extra
    # What the derived model issues is what its plan says, call for call.
    for g in (got,):
        want = {op: v["calls"] for op, v in g["predicted"].items()}
        assert Counter(op for op, _ in g["derived"]) == Counter(want)


def test_derived_context_parallelism_equals_hand_written_cp(pools):
    """seq over cp derives what `--cp 2` issues, operation for operation in issue order (kind, group,
    bytes, ring peer) over one whole training step; and the plan predicts the ring's messages and the
    loss's all-reduce on the cp group. At tp 2 x cp 2 the cp group's traffic is again the hand-written's."""
    from sharding_ranks import cp_traces

    got = pools(2).run(cp_traces, ["layout.cp=2", "sharding.compute=seq=cp"])[0]
    assert got["hand"] == got["derived"] and got["plan_has_context"], json.dumps(got)
    assert got["derived swapped"] == got["hand swapped"] == ["ZigzagTokens", "RingAttend"]
    cp = got["cp_ranks"]
    on_cp = Counter((op, b) for op, ranks, b, *_ in got["derived"] if ranks == cp)
    sends = Counter(b for (op, b), k in on_cp.items() for _ in range(k) if op == "send")
    assert on_cp[("all_reduce", 4)] == 1 and sum(sends.values()) == got["predicted_cp"]["sendrecv"]["calls"]
    assert sum(b * k for b, k in sends.items()) == got["predicted_cp"]["sendrecv"]["bytes"]
    assert {op for op, _ in on_cp} == {"send", "recv", "all_reduce"}
    # Megatron TP x CP: the vocabulary-cut head differs on tp (docs/sharding.md), the cp ring does not.
    got = pools(4).run(cp_traces, ["layout.cp=2", "layout.tp=2", f"sharding.compute={MEGATRON}, seq=cp"])[0]
    cp = got["cp_ranks"]
    hand, derived = ([e for e in got[k] if e[1] == cp] for k in ("hand", "derived"))
    # At dp 1 the weights' replica group (dp x cp) is the cp group: + the loss's and the gradients' all-reduces.
    assert hand == derived and len(derived) == 2 * got["predicted_cp"]["sendrecv"]["calls"] + 2, json.dumps(got)


# ------------------------------------------------------------------------------------- verify
def _cfg(model: str, dp: int, tp: int, *extra: str) -> dict:
    cfg = load_config(None, [f'model.name="{model}"', f"layout.dp={dp}", f"layout.tp={tp}", *extra], base=VERIFY_BASE)
    cfg.validate()
    return cfg.to_dict()


def _verify(pools, cfg: dict, world: int) -> dict:  # noqa: ANN001
    from shardlab.train.verify import verify_rank

    report = pools(world).run(verify_rank, cfg, 1e-6, 1e-5)[0]
    assert report["passed"], json.dumps(report["per_step"], indent=1)
    return report


def test_verify_megatron_and_sequence_parallel_rules(pools):
    _verify(pools, _cfg("gpt", 1, 2, f"sharding.compute={MEGATRON}, seq=tp", "train.steps=3"), 2)
    _verify(pools, _cfg("mlp", 1, 2, "sharding.compute=mlp=tp", "train.steps=3"), 2)
    # Full recomputation re-runs each block's forward, its derived entry and exit collectives included.
    _verify(pools, _cfg("gpt", 1, 2, f"sharding.compute={MEGATRON}, seq=tp", 'layout.recompute="full"',
                        "train.steps=3"), 2)
    _verify(pools, _cfg("gpt", 1, 2, f"sharding.compute={MEGATRON}", 'layout.recompute="selective"',
                        "train.steps=2"), 2)
    # bf16 with fp32 masters: the fp32 sources are cut with the weights (compile.py), so the masters start
    # from the fp32 initialisation as the reference's do.
    from shardlab.train.verify import MIXED_VERIFY_BASE

    _verify(pools, _cfg("gpt", 1, 2, f"sharding.compute={MEGATRON}", 'layout.precision="bf16"', "train.steps=3",
                        *MIXED_VERIFY_BASE), 2)


def test_verify_fsdp_with_derived_tensor_parallelism(pools):
    # No hand-written strategy has this one config: weights stored over dp (FSDP), heads/mlp/vocab over tp,
    # the sequence over tp between blocks, with two micro-batches.
    _verify(pools, _cfg("gpt", 2, 2, f"sharding.compute={MEGATRON}, seq=tp", "sharding.params=embed=dp",
                        "train.steps=3", "train.micro_batches=2"), 4)


def test_verify_context_parallel_rules(pools):
    # seq over cp alone (2 ranks), and with Megatron TP and sequence parallelism over tp (4 ranks).
    _verify(pools, _cfg("gpt", 1, 1, "layout.cp=2", "sharding.compute=seq=cp", "train.steps=3"), 2)
    # Rotary positions offset by the shard, grouped-query heads on the ring, the ring recomputed in backward.
    _verify(pools, _cfg("gpt", 1, 1, "layout.cp=2", "sharding.compute=seq=cp", "model.rotary=true", "model.n_kv_head=2",
                        'layout.recompute="selective"', "train.steps=2"), 2)
    _verify(pools, _cfg("gpt", 1, 2, "layout.cp=2", f"sharding.compute={MEGATRON}, seq=cp+tp", "train.steps=2"), 4)


@pytest.mark.parametrize("world, sets", [
    # bf16 with fp32 masters through the rules: the ring's blocks in fp32, k/v travelling in bf16; the
    # allowance is verify's mixed-precision one (2 x the bf16 reference's own distance from fp32).
    (2, ["layout.cp=2", "sharding.compute=seq=cp", 'layout.precision="bf16"']),
    # fp16 (loss scaling; rotary positions offset by the zigzag chunks' places).
    (2, ["layout.cp=2", "sharding.compute=seq=cp", 'layout.precision="fp16"', "model.rotary=true"]),
    # ZeRO-2 over the replica group dp x cp (4 ranks): gradients reduce-scattered during backward.
    (4, ["layout.dp=2", "layout.cp=2", "sharding.compute=seq=cp", "layout.zero=2"]),
    # tp x cp x ZeRO-1: Megatron TP rules with seq over cp, optimizer state sharded over cp's replicas.
    (4, ["layout.tp=2", "layout.cp=2", f"sharding.compute={MEGATRON}, seq=cp", "layout.zero=1"]),
], ids=["cp2-bf16", "cp2-fp16-rotary", "dp2-cp2-zero2", "tp2-cp2-zero1"])
def test_verify_context_parallel_rules_with_zero_and_bf16(pools, world, sets):
    from shardlab.train.verify import MIXED_VERIFY_BASE

    mixed = any("bf16" in s or "fp16" in s for s in sets)
    report = _verify(pools, _cfg("gpt", 1, 1, *sets, "train.steps=2", *(MIXED_VERIFY_BASE if mixed else [])), world)
    if mixed:  # the mixed-precision allowance was in play (a bf16/fp16 run cannot meet the fp32 bars)
        assert report["mp_factor"] > 0 and report["max_rel_grad_diff"] > 1e-5, report
    else:
        from sharding_ranks import engine_under_rules

        got = pools(world).run(engine_under_rules, ['model.name="gpt"', *sets])[0]
        zero = int(next(s for s in sets if s.startswith("layout.zero=")).split("=")[1])
        assert got == {"engine": "ZeroDataParallel", "stage": zero, "replicas": world // (2 if "layout.tp=2" in sets else 1),
                       "context": "cp", "swapped": ["ZigzagTokens", "RingAttend"]}, got


@pytest.mark.slow
def test_verify_fsdp_heads_over_tp_seq_over_cp_on_eight_ranks(pools):
    # The issue's example, which no hand-written flag set spells: weights stored over dp (FSDP), heads,
    # mlp and vocab over tp, the sequence over cp (the ring), on dp 2 x tp 2 x cp 2.
    _verify(pools, _cfg("gpt", 2, 2, "layout.cp=2", f"sharding.compute={MEGATRON}, seq=cp", "sharding.params=embed=dp",
                        "train.steps=2"), 8)


# ---------------------------------------------------------------------------------- randomized
def _predicted_refusal(model: str, rules: dict, tp: int, cp: int, shape: dict) -> bool:
    """Whether the rules must be refused, worked out here from the shapes (not from the derivation)."""
    if model == "mlp":
        return ("embed" in rules and "mlp" in rules) or shape["d_model"] % tp != 0
    kv, t = shape["n_kv_head"], shape["seq_len"]
    seq = rules.get("seq", "")
    return ("embed" in rules or "ctx" in rules
            or ("heads" in rules and (shape["n_head"] % tp or kv % tp))
            or ("mlp" in rules and shape["d_ff"] % tp) or ("vocab" in rules and 256 % tp)
            or (seq == "tp" and t % tp)
            or (cp > 1 and "cp" not in seq)                       # layout.cp under rules is seq over cp
            or ("cp" in seq and t % (2 * cp))                     # the zigzag split: 2 chunks per cp rank
            or (seq == "cp+tp" and (t // cp) % tp))


def _draws(rng: random.Random, count: int):  # noqa: ANN202
    """(model, dp, cp, tp, rules, shape, store) draws: meshes of 2 or 4 ranks over dp x cp x tp."""
    for _ in range(count):
        model = rng.choice(["gpt", "mlp"])
        world = rng.choice([2, 4])
        tp = rng.choice([2, world]) if model == "mlp" else rng.choice([1, 2, world])
        cp = rng.choice([1, world // tp]) if model == "gpt" else 1
        dp = world // tp // cp
        names = ["heads", "mlp", "vocab", "seq", "embed", "ctx"] if model == "gpt" else ["mlp", "embed"]
        rules = {n: "tp" for n in names if rng.random() < 0.45} or {names[0]: "tp"}
        if "seq" in rules or cp > 1 and rng.random() < 0.8:
            rules["seq"] = rng.choice(["tp", "cp", "cp+tp"])
        shape = {"n_head": rng.choice([2, 4]), "d_ff": rng.choice([96, 128]), "seq_len": rng.choice([20, 24, 32]),
                 "d_model": 32 if model == "gpt" else rng.choice([24, 32])}
        shape["n_kv_head"] = rng.choice([1, shape["n_head"]])
        yield model, dp, cp, tp, rules, shape, rng.random() < 0.3 and dp > 1


def test_randomized_rules_and_meshes_against_one_process(pools):
    ran = refused = 0
    seen: set[tuple] = set()
    for model, dp, cp, tp, rules, shape, store in _draws(random.Random(2), 40):
        sets = [f"model.{k}={v}" for k, v in shape.items() if model == "gpt" or k == "d_model"]
        sets += ["sharding.compute=" + ", ".join(f"{k}={v}" for k, v in rules.items()), "train.steps=2"]
        sets += ["sharding.params=embed=dp"] if store else []
        cfg = load_config(None, [f'model.name="{model}"', f"layout.dp={dp}", f"layout.tp={tp}", f"layout.cp={cp}",
                                 *sets], base=VERIFY_BASE)
        must_refuse = _predicted_refusal(model, rules, tp, cp, shape)
        mesh = f"dp {dp} x cp {cp} x tp {tp}"
        try:
            cfg.validate()
        except ConfigError as exc:
            assert must_refuse, f"{sets} at {mesh} was refused but is derivable: {exc}"
            refused += 1
            continue
        assert not must_refuse, f"{sets} at {mesh} was accepted but cannot be derived"
        key = (model, dp * cp * tp, dp, cp > 1, store)
        if ran < 4 and key not in seen:  # each run costs seconds: four accepted draws of different kinds
            seen.add(key)
            _verify(pools, cfg.to_dict(), dp * cp * tp)
            ran += 1
    assert ran == 4 and refused >= 5 and any(w == 4 for _, w, *_ in seen) and any(c for *_, c, _ in seen), seen


# ---------------------------------------------------------------------------------- explain CLI
def test_explain_prints_the_plan_and_refuses_bad_rules(capsys):
    from shardlab.cli.main import main

    args = ["explain", "--model", "gpt", "--tp", "2", "--dp", "2", "--set", "model.n_layer=2",
            "--set", f"sharding.compute={MEGATRON}, seq=tp", "--set", "sharding.params=embed=dp"]
    assert main(args + ["--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    attn = next(m for m in d["modules"] if m["name"] == "blocks.0.attn")
    assert attn["in"] == "(batch/dp, seq/tp, embed)"
    (entry,) = attn["collectives"]
    assert (entry["function"], entry["fwd"], entry["bwd"], entry["group"]) == \
        ("gather_from_sequence", "all_gather", "reduce_scatter", "tp[2] [0, 1]")
    assert entry["fwd_bytes"] == entry["bwd_bytes"] > 0 and entry["predicted_s"] > 0
    assert d["fsdp"] and {c["group"] for c in d["data_parallel"]} == {"dp[2] [0, 2]"}
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "blocks.1.mlp.proj" in text and "per step:" in text and "reduce_scatter_to_sequence" in text
    # Context parallelism: each attention core's ring, forward and backward, with bytes and a predicted time.
    assert main(["explain", "--model", "gpt", "--tp", "2", "--cp", "2", "--set", "model.n_layer=2", "--set",
                 f"sharding.compute={MEGATRON}, seq=cp", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    core = next(m for m in d["modules"] if m["name"] == "blocks.1.attn.attend")
    kv, grad = core["collectives"]
    assert (kv["fwd"], kv["fwd_calls"], kv["bwd_calls"], kv["group"]) == ("sendrecv", 1, 1, "cp[2] [0, 2]")
    assert kv["fwd_bytes"] == kv["bwd_bytes"] > 0 and grad["bwd_bytes"] == 2 * kv["fwd_bytes"] and kv["predicted_s"] > 0
    assert {c["group"] for c in d["data_parallel"]} == {"dp+cp[2] [0, 2]"}
    # Under ZeRO-1/2 the engine reduce-scatters the gradients and all-gathers the updated chunks (not one all-reduce).
    assert main(["explain", "--model", "gpt", "--dp", "2", "--cp", "2", "--zero", "2", "--set", "model.n_layer=2",
                 "--set", "sharding.compute=seq=cp", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert [(c["at"], c["fwd"], c["bwd"], c["group"]) for c in d["data_parallel"]] == [
        ("gradients", "-", "reduce_scatter", "dp+cp[4] [0, 1, 2, 3]"), ("weights", "all_gather", "-", "dp+cp[4] [0, 1, 2, 3]")]
    assert main(["explain", "--model", "mlp", "--tp", "2", "--set", "sharding.compute=embed=tp, mlp=tp"]) == 2
    assert "used twice in one tensor" in capsys.readouterr().err


def test_bench_train_runs_the_derived_variant(pools, monkeypatch, tmp_path, capsys):
    """`shardlab bench train --tp 2 --variants tp,decl`: the derived layout passes the benchmark's loss
    check beside the hand-written one and moves Megatron's 4 all-reduces per layer (tiny GPT; no time asserted)."""
    import shardlab.dist
    from shardlab.cli.main import main

    monkeypatch.setattr(shardlab.dist, "launch", lambda fn, ws, *args, **kw: pools(ws).run(fn, *args))
    tiny = ["model.name=gpt", "model.d_model=32", "model.n_layer=2", "model.n_head=2", "model.seq_len=16",
            "train.global_batch=2"]
    out = tmp_path / "b.json"
    assert main(["bench", "train", "--tp", "2", *[a for kv in tiny for a in ("--set", kv)], "--variants", "tp,decl",
                 "--runs", "1", "--reps", "1", "--steps", "1", "--warmup", "1", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert {r["variant"] for r in result["rows"]} == {"tp", "decl"}
    tp = result["tp"]
    assert tp["check"]["max_rel_diff"]["decl"] <= tp["check"]["rtol"]
    act = 2 * 16 * 32 * 4
    assert tp["comm"]["decl"]["counted"]["per_layer"] == tp["comm"]["tp"]["counted"]["per_layer"] == \
        {"all_reduce": {"calls": 4, "bytes": 4 * act, "bus_bytes": 4 * act}}


def test_checkpoint_of_a_derived_layout_loads_into_the_hand_written_one(pools, tmp_path):
    """The placement record written from the plan is what checkpoints read: a derived TP+SP layout's
    checkpoint loads exactly into the hand-written tp layout and into another derived one."""
    from sharding_ranks import checkpoint_across

    got = pools(2).run(checkpoint_across, str(tmp_path / "ck"))[0]
    assert got["hand-written"] == [] and got["derived"] == []
    assert got["hand-written trained"] and got["derived trained"]  # a fresh model differs: the load did it


# ------------------------------------------------------------- whole modules: layers over pp, experts over ep
def test_rules_place_layers_over_pp_and_experts_over_ep():
    plan = derive(_gpt(n_layer=4, n_experts=4), Rules.parse("layers=pp, experts=ep"), {"pp": 2, "ep": 2}, rows=2,
                  micro_batches=2)
    assert (plan.pipeline_axis, plan.expert_axis) == ("pp", "ep")
    # The trainer's even split: embedding + blocks 0-1 on pp rank 0, blocks 2-3 + head on pp rank 1.
    owner = {m.name: m.stage for m in plan.modules}
    assert owner["tok_emb"] == owner["blocks.1.mlp"] == 0 and owner["blocks.2.ln1"] == owner["head"] == 1
    (stage,) = [m for m in plan.modules if m.kind == "pipeline"]
    (boundary,) = stage.exit
    hidden = 2 * 16 * 32 * 4   # rows x tokens x d_model x fp32, one micro-batch
    assert (stage.name, boundary.fwd, boundary.bwd, boundary.axis, boundary.nbytes) == \
        ("stage 0 -> 1", "p2p", "p2p", "pp", hidden)
    mlp = plan.module("blocks.0.mlp")
    assert mlp.kind == "experts" and [c.fn for c in mlp.collectives()] == \
        ["expert_counts", "expert_dispatch", "expert_combine"]
    # Per layer: the counts forward, dispatch and combine forward and backward; rows x top_k (2) x d each.
    assert plan.counts(axis="ep") == {"all_to_all": {"calls": 4 * 5, "bytes": 4 * (4 * 8 + 4 * 2 * hidden)}}
    # The boundary's message and its gradient, and the tied embedding's (64 x 32 fp32) gradient exchange.
    assert plan.counts(axis="pp") == {"p2p": {"calls": 2 + 1, "bytes": 2 * hidden + 64 * 32 * 4}}
    # Dense weights over dp x ep (rank 0: its stage's only), experts over dp (1 rank: none); the tied
    # embedding's copies exchange gradients over pp.
    data = {(c.module, c.axis, c.bwd) for c in plan.data}
    assert data == {("(dense weights)", "dp+ep", "all_reduce"), ("(tied tok_emb / head)", "pp", "p2p")}
    # Interleaved: 2 chunks per rank, chunk c on pp rank c mod 2.
    plan = derive(_gpt(n_layer=4), Rules.parse("layers=pp"), {"pp": 2}, rows=2, virtual_stages=2)
    assert [m.name for m in plan.modules if m.kind == "pipeline"] == ["stage 0 -> 1", "stage 1 -> 2", "stage 2 -> 3"]
    assert [plan.module(f"blocks.{i}.ln1").stage for i in range(4)] == [0, 1, 0, 1]
    # Refused, each with its reason.
    assert "no mixture of experts" in _refusal(_gpt(), "experts=ep", {"ep": 2})
    assert "3 experts cannot be placed whole over ep = 2" in _refusal(_gpt(n_experts=3, top_k=1), "experts=ep", {"ep": 2})
    assert "derived for dense models only" in _refusal(_gpt(n_experts=4), f"{MEGATRON}, experts=ep", {"tp": 2, "ep": 2})
    assert "pipeline split of a model whose sequence the rules cut" in _refusal(
        _gpt(), f"layers=pp, {MEGATRON}, seq=tp", {"pp": 2, "tp": 2})
    # The deep MLP's 3 layers over 2 stages: the boundary after layer 0 (column: features cut over tp).
    assert "layers.0: a pipeline boundary (layers=pp) falls where the rules leave the hidden state (batch, mlp/tp)" \
        in _refusal(DeepMLP(MLPConfig(d_model=16, n_layer=3)), "layers=pp, mlp=tp", {"pp": 2, "tp": 2})
    assert "under rules, the pipeline is the rule layers=pp" in _refusal(_gpt(), MEGATRON, {"pp": 2, "tp": 2})
    assert "expert parallelism is the rule experts=ep" in _refusal(_gpt(n_experts=4), "seq=cp", {"ep": 2, "cp": 2})
    assert "layers index whole modules" in _refusal(_gpt(), "layers=tp", {"tp": 2})
    assert "'ep' places whole modules" in _refusal(_gpt(), "mlp=ep", {"ep": 2})
    cfg = load_config(None, ["layout.pp=2", "train.micro_batches=2", "sharding.compute=batch=dp"], base=VERIFY_BASE)
    with pytest.raises(ConfigError, match="the pipeline is the rule layers=pp"):
        cfg.validate()


@pytest.mark.parametrize("world,sets", [
    (4, ["layout.pp=2", "layout.ep=2", "train.micro_batches=2", "model.experts=4", "sharding.compute=layers=pp, experts=ep"]),
    (2, ["layout.ep=2", "model.experts=4", "sharding.compute=experts=ep"]),
    (4, ["layout.cp=2", "layout.ep=2", "model.experts=4", "model.capacity_factor=0.5", "sharding.compute=seq=cp, experts=ep"]),
])
def test_placing_rules_issue_the_hand_written_trace(pools, world, sets):
    """Layers over pp and experts over ep (and with seq over cp) issue what `--pp 2 --ep 2` (`--ep 2`,
    `--cp 2 --ep 2`) issues over one whole training step, operation for operation in issue order
    (kind, group, bytes, peer): the pipeline's messages, the all-to-alls, the gradient reductions."""
    from sharding_ranks import layout_traces

    got = pools(world).run(layout_traces, sets)[0]
    assert got["hand"] == got["derived"] and got["hand built"] == got["derived built"], json.dumps(got)
    ops = {op for op, *_ in got["derived"]}
    # Point-to-point: the pipeline's messages, or the ring attention's.
    assert "all_to_all" in ops and ("send" in ops) == ("layout.pp=2" in sets or "layout.cp=2" in sets), ops
    assert got["plan_axes"] == ["pp" if "layout.pp=2" in sets else None, "ep", "cp" if "layout.cp=2" in sets else None]


def test_verify_pipeline_and_experts_rules(pools):
    # The issue's done-when: a pipeline-and-experts layout from rules (pp 2 x ep 2, 4 ranks) equal to one process.
    report = _verify(pools, _cfg("gpt", 1, 1, "layout.pp=2", "layout.ep=2", "train.micro_batches=2", "model.experts=4",
                                 "model.aux_loss_coef=0.1", "sharding.compute=layers=pp, experts=ep"), 4)
    assert report["max_rel_loss_diff"] < 1e-6


def test_verify_layers_over_pp_with_megatron_rules(pools):
    """pp 2 x tp 2 from rules (4 ranks): the Megatron rules compiled onto the whole GPT, then split into
    the trainer's stages. Not trace-equal to `--pp 2 --tp 2` (the derived head gathers the logits, as
    at pp 1), so held to one process; and the stages are known to hold the derived leaves."""
    from sharding_ranks import built

    sets = ["layout.pp=2", "train.micro_batches=2", "layout.schedule='interleaved'", "layout.virtual_stages=2",
            "model.n_layer=4", f"sharding.compute=layers=pp, {MEGATRON}"]
    assert {"PipelineParallel", "DerivedLinear", "DerivedEmbedding"} <= set(pools(4).run(built, ["layout.tp=2", *sets])[0])
    _verify(pools, _cfg("gpt", 1, 2, *sets), 4)


def test_explain_prints_a_pipeline_and_experts_layout_from_rules(capsys):
    from shardlab.cli.main import main

    assert main(["explain", "--config", "configs/gpt-moe-rules.toml", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["rules"] == "compute: layers=pp, experts=ep" and d["mesh"].startswith("pp 2 x ep 2 (4 ranks")
    assert [m["stage"] for m in d["modules"] if m["name"] in ("tok_emb", "head")] == [0, 1]
    (boundary,) = [c for m in d["modules"] if m["kind"] == "pipeline" for c in m["collectives"]]
    assert (boundary["fwd"], boundary["bwd"], boundary["group"]) == ("p2p", "p2p", "pp[2] [0, 2]")
    dispatch = next(c for m in d["modules"] if m["kind"] == "experts" for c in m["collectives"]
                    if c["function"] == "expert_dispatch")
    assert (dispatch["fwd"], dispatch["bwd"], dispatch["group"]) == ("all_to_all", "all_to_all", "ep[2] [0, 1]")
    assert dispatch["predicted_s"] > 0 and boundary["predicted_s"] > 0
    # Rank 0's step: per micro-batch (2) its 2 mixtures' 5 all-to-alls and the boundary's 2 messages; then
    # the dense gradients' all-reduce over dp x ep and the tied embedding's exchange.
    assert d["per_step"]["calls"] == 2 * (2 * 5 + 2) + 2
    assert main(["explain", "--config", "configs/gpt-moe-rules.toml"]) == 0
    text = capsys.readouterr().out
    assert "stage 0 -> 1" in text and "[pp rank 1]" in text and "expert_combine" in text
