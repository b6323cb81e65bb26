"""Hugging Face and torch.distributed.checkpoint interop, end to end on tiny fp32 models.

Export: a sharded checkpoint written by the trainer (GPT-2 shape under ZeRO-3, Llama shape under
tensor parallelism) goes through `shardlab checkpoint export --hf --dcp`; transformers loads it as
GPT2LMHeadModel / LlamaForCausalLM with the same logits as shardlab's model, and DCP loads the same
tensors. Import: a random model made by transformers itself and saved to a temporary directory
starts `shardlab train --init-from-hf` with its logits and its loss. Nothing is downloaded
(HF_HUB_OFFLINE). transformers is imported once, here only: it takes seconds.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from shardlab.checkpoint import CheckpointError, full_tensors  # noqa: E402
from shardlab.checkpoint.hf import hf_family  # noqa: E402
from shardlab.cli.main import build_parser, main  # noqa: E402
from shardlab.models import GPT, GPTConfig  # noqa: E402
from shardlab.train.config import Config, load_config  # noqa: E402
from shardlab.train.presets import FAMILIES  # noqa: E402
from shardlab.train.resolve import resolve_run  # noqa: E402
from shardlab.train.task import gpt_config  # noqa: E402

SHAPE = ["model.n_layer=2", "model.d_model=32", "model.n_head=4", "model.d_ff=48"]
TINY = ["model.seq_len=16", "train.global_batch=4", "train.steps=2", "train.warmup_steps=1", "train.eval_every=0", "train.eval_batches=1",
        "data.max_bytes=262144", "log.sample_tokens=0", "log.plot=false", "log.tensorboard=false", "log.memory=false"]


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


@pytest.mark.filterwarnings("ignore:.*single process.*:UserWarning")
@pytest.mark.parametrize("family,layout,hf_class", [
    ("gpt2", ["layout.dp=2", "layout.zero=3"], "GPT2LMHeadModel"),
    ("llama", ["layout.tp=2", "layout.sp=true"], "LlamaForCausalLM"),
])
def test_trained_checkpoint_exports_to_transformers_and_dcp(pools, tmp_path, family, layout, hf_class):
    import torch.distributed.checkpoint as dcp

    from shardlab.train.loop import train_rank

    cfg = load_config(None, [*FAMILIES[family], *SHAPE, *TINY, *layout, "checkpoint.every=2", "checkpoint.async_save=false",
                             f'log.out_dir="{tmp_path / "run"}"'])
    cfg.validate(world_size=2)
    pools(2).run(train_rank, resolve_run(cfg))
    ckpt = tmp_path / "run" / "checkpoints"
    assert main(["checkpoint", "export", str(ckpt), "--hf", str(tmp_path / "hf"), "--dcp", str(tmp_path / "dcp")]) == 0

    whole = full_tensors(ckpt)
    ours = GPT(gpt_config(cfg.model)).eval()
    ours.load_state_dict(whole)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(theirs).__name__ == hf_class
    idx = torch.randint(0, 256, (3, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(theirs(idx).logits, ours(idx), rtol=0, atol=1e-5)

    # DCP reads what we wrote with no process group, into tensors it is given (as torchtitan does).
    loaded = {"model": {n: torch.zeros_like(t) for n, t in ours.state_dict().items()}}  # tied head included
    dcp.load(loaded, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    for n, t in loaded["model"].items():
        assert torch.equal(t, whole[n]), n

    # `shardlab generate` on the sharded checkpoint (read into one process) and transformers' greedy
    # generate on the export continue a prompt alike.
    from shardlab.train.generate import load_for_generation

    prompt = list(b"def f(")
    with torch.no_grad():
        hf_ids = theirs.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0].tolist()
    assert load_for_generation(ckpt).generate_ids(prompt, 8, temperature=0) == hf_ids


def test_shapes_neither_family_has_are_refused():
    with pytest.raises(CheckpointError, match="neither GPT-2.*nor Llama"):
        hf_family(GPTConfig(n_layer=1, d_model=32, n_head=4, rotary=True))  # layernorm with rotary
    with pytest.raises(CheckpointError, match="mixture of experts"):
        hf_family(GPTConfig(n_layer=1, d_model=32, n_head=4, n_experts=2))


def _hf_model(family: str, path) -> torch.nn.Module:
    """A random transformers model of `family`, its every weight perturbed (biases and gains too)."""
    torch.manual_seed(3)
    if family == "llama":
        config = transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                          rms_norm_eps=1e-5, tie_word_embeddings=False)
        model = transformers.LlamaForCausalLM(config)
    else:  # GPT-2's defaults: gelu_new, biases, tied head
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=256, n_positions=64, n_embd=32,
                                                                     n_layer=2, n_head=4))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    model.save_pretrained(path)
    return model.eval()


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_training_starts_from_a_transformers_checkpoint(pools, tmp_path, family):
    from shardlab.cli.train import check_before_launch, resolve_config
    from shardlab.train.loop import train_rank

    theirs = _hf_model(family, tmp_path / "hf")
    args = build_parser().parse_args(["train", "--init-from-hf", str(tmp_path / "hf"), *sum((["--set", a] for a in TINY), []),
                                      "--set", f'log.out_dir="{tmp_path / "run"}"'])
    cfg = resolve_config(args)
    cfg.validate(world_size=1)
    check_before_launch(cfg, make_out_dir=False)
    assert (cfg.model.norm, cfg.model.mlp) == (("rmsnorm", "swiglu") if family == "llama" else ("layernorm", "gelu_tanh"))
    ours = resolve_run(cfg).build_model().eval()
    task = resolve_run(cfg).build_task(ours)
    x, y = task.global_batch(0)
    with torch.no_grad():
        logits = theirs(x).logits
        torch.testing.assert_close(ours(x), logits, rtol=0, atol=1e-5)
        hf_loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1)).item()
    if family == "llama":  # the trainer's first step sees the checkpoint's loss on its first batch
        summary = pools(1).run(train_rank, resolve_run(cfg))[0]
        assert summary["first_loss"] == pytest.approx(hf_loss, rel=1e-5)

    # seq_len 16 of the checkpoint's 64 positions: accepted (GPT-2 keeps the table's first 16 rows).
    # A model.* field changed after --init-from-hf no longer fits the checkpoint: refused before launch.
    from shardlab.train.config import ConfigError

    bad = Config.from_dict(cfg.to_dict())
    bad.model.d_model = 64
    with pytest.raises(ConfigError, match="model.d_model = 64, but the checkpoint"):
        check_before_launch(bad, make_out_dir=False)

    # A tensor of another shape, one missing, a damaged file: named before launch from the files'
    # headers, not by a traceback in every rank.
    from safetensors.torch import load_file, save_file

    (stored,) = (tmp_path / "hf").glob("*.safetensors")
    tensors = load_file(str(stored))
    norm = next(k for k in tensors if k.endswith("layers.1.input_layernorm.weight" if family == "llama" else "h.1.ln_1.weight"))
    save_file({**tensors, norm: tensors[norm][:-1].clone()}, str(stored), metadata={"format": "pt"})
    with pytest.raises(ConfigError, match=r"blocks.1.ln1.weight \(31,\) \(model \(32,\)\)"):
        check_before_launch(cfg, make_out_dir=False)
    save_file({k: v for k, v in tensors.items() if k != norm}, str(stored), metadata={"format": "pt"})
    with pytest.raises(ConfigError, match=f"tensor .*{norm.split('.', 1)[-1]} is missing"):
        check_before_launch(cfg, make_out_dir=False)
    stored.write_bytes(stored.read_bytes()[:100])
    with pytest.raises(ConfigError, match="model.init_from_hf = "):
        check_before_launch(cfg, make_out_dir=False)


def _bpe_run(tmp_path, family="gpt2"):
    """A GPT with random weights saved as a checkpoint of a run on a token file made with a BPE of at
    most 300 ids (the model's vocabulary padded to 320): what an export must carry whole."""
    from shardlab.checkpoint import save_checkpoint
    from shardlab.data.prepare import prepare
    from shardlab.train.task import build_model

    text = tmp_path / "corpus.txt"
    text.write_text("def f(x):\n    return x + 1\n\nclass A:\n    pass\n" * 40)
    prepare([str(text)], tmp_path / "corpus.tok", train_bpe=300, workers=1, progress=False, log=lambda m: None)
    cfg = load_config(None, [*FAMILIES[family], *SHAPE, "model.seq_len=32", f'data.source="{tmp_path / "corpus.tok"}"',
                             f'log.out_dir="{tmp_path / "run"}"'])
    cfg.model.vocab_size = resolve_run(cfg).vocab
    torch.manual_seed(5)
    model = build_model(cfg.model)
    with torch.no_grad():  # no two logits alike, the padded rows' too
        for p in model.parameters():
            p.add_(0.2 * torch.randn_like(p))
    save_checkpoint(tmp_path / "run" / "checkpoints", 7, model, config=cfg.to_dict())
    return cfg, model


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_export_travels_with_its_tokenizer_and_generates_as_shardlab_does(tmp_path, capsys, family):
    from shardlab.train.generate import load_for_generation

    from shardlab.train.corpus import DataSource

    cfg, _ = _bpe_run(tmp_path, family)
    vocab = DataSource(cfg.data).vocab  # what the BPE learned of its 300 on this small text
    assert 256 < vocab <= 300 and cfg.model.vocab_size == 320
    out = tmp_path / "hf"
    assert main(["checkpoint", "export", str(tmp_path / "run" / "checkpoints"), "--hf", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"ids {vocab}-319 suppressed" in printed and "eos_token_id 0 ('<|endoftext|>')" in printed

    tok = transformers.AutoTokenizer.from_pretrained(out)
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert (tok.eos_token, tok.eos_token_id, model.config.eos_token_id, model.config.bos_token_id) == \
        ("<|endoftext|>", 0, 0, 0)
    ours = load_for_generation(tmp_path / "run")
    prompt = "def f(x):\n"
    ids = tok(prompt).input_ids
    assert ids == ours.encode(prompt)  # the same tokenizer, no special token added
    with torch.no_grad():
        theirs = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)[0].tolist()
    mine = ours.generate_ids(ids, 12, temperature=0)
    assert theirs == mine and max(mine) < vocab
    assert tok.decode(theirs) == ours.tokenizer.decode(mine)
    # `shardlab generate` on the export (its own tokenizer.json) prints the same text.
    assert main(["generate", str(out), "--prompt", prompt, "--tokens", "12", "--temperature", "0"]) == 0
    assert capsys.readouterr().out == tok.decode(theirs) + "\n"


def test_export_keeps_the_source_models_positions_and_dropout(tmp_path, capsys):
    from shardlab.checkpoint import save_checkpoint

    theirs = _hf_model("gpt2", tmp_path / "src")  # 64 positions, dropout 0.1 (GPT-2's defaults)
    args = build_parser().parse_args(["train", "--init-from-hf", str(tmp_path / "src"), "--set", "model.seq_len=16",
                                      "--set", f'log.out_dir="{tmp_path / "run"}"'])
    from shardlab.cli.train import resolve_config

    cfg = resolve_config(args)
    model = resolve_run(cfg).build_model()
    with torch.no_grad():
        model.pos_emb.weight.add_(1.0)  # "trained": the 16 rows differ from the source's
    save_checkpoint(tmp_path / "run" / "checkpoints", 3, model, config=cfg.to_dict())
    assert main(["checkpoint", "export", str(tmp_path / "run" / "checkpoints"), "--hf", str(tmp_path / "hf")]) == 0
    printed = capsys.readouterr().out
    assert "n_positions 16 -> 64" in printed and "dropout 0.1: model.dropout, what was trained" in printed
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    c = exported.config
    # GPT-2's 0.1 was trained (model.dropout from resid_pdrop); shardlab has no embedding dropout.
    assert cfg.model.dropout == 0.1 and (c.n_positions, c.resid_pdrop, c.embd_pdrop, c.attn_pdrop) == (64, 0.1, 0.0, 0.1)
    wpe, source = exported.transformer.wpe.weight, theirs.transformer.wpe.weight
    assert torch.equal(wpe[:16], model.pos_emb.weight) and torch.equal(wpe[16:], source[16:])


@pytest.mark.filterwarnings("ignore:.*single process.*:UserWarning")
def test_the_documented_dcp_snippet_loads_into_the_models_own_state_dict(tmp_path, monkeypatch):
    """docs/models.md's DCP example, run as written (its paths pointed at this test's files), on a
    model with a tied head: every key of state_dict() is found, the values are the checkpoint's."""
    import re
    from pathlib import Path

    from shardlab.checkpoint import save_checkpoint
    from shardlab.train.task import build_model

    cfg = load_config(None, [*FAMILIES["gpt2"], *SHAPE, "model.vocab_size=256", f'log.out_dir="{tmp_path / "run"}"'])
    assert cfg.model.tie_embeddings
    torch.manual_seed(2)
    saved = build_model(cfg.model)
    save_checkpoint(tmp_path / "run" / "checkpoints", 4, saved, config=cfg.to_dict())
    (tmp_path / "run" / "config.toml").write_text(cfg.to_toml())  # as the trainer writes it
    assert main(["checkpoint", "export", str(tmp_path / "run" / "checkpoints"), "--dcp", str(tmp_path / "dcp")]) == 0
    page = (Path(__file__).resolve().parent.parent / "docs" / "models.md").read_text()
    section = page.split("## torch.distributed.checkpoint")[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    monkeypatch.chdir(tmp_path)  # the snippet's paths: runs/x/config.toml and dcp-ckpt
    (tmp_path / "runs").mkdir()
    (tmp_path / "run").rename(tmp_path / "runs" / "x")
    (tmp_path / "dcp").rename(tmp_path / "dcp-ckpt")
    scope: dict = {}
    exec(compile(code, "docs/models.md", "exec"), scope)
    model = scope["model"]
    for name, t in saved.state_dict().items():
        assert torch.equal(model.state_dict()[name], t), name
    assert model.head.weight is model.tok_emb.weight  # still tied after loading


def test_import_keeps_gpt2_dropout_and_names_what_it_cannot_keep(tmp_path, capsys):
    """--init-from-hf: GPT-2's resid_pdrop becomes model.dropout (it trained with 0.0 before, silently),
    --set after it may change it, and the fields shardlab cannot train as the source did are named."""
    from shardlab.cli.train import check_before_launch, resolve_config

    _hf_model("gpt2", tmp_path / "src")
    config = json.loads((tmp_path / "src" / "config.json").read_text())
    config.update(resid_pdrop=0.2, attn_pdrop=0.05, embd_pdrop=0.1)
    (tmp_path / "src" / "config.json").write_text(json.dumps(config))
    args = build_parser().parse_args(["train", "--init-from-hf", str(tmp_path / "src"), "--set", "model.seq_len=16"])
    assert resolve_config(args).model.dropout == 0.2
    err = capsys.readouterr().err
    assert "attn_pdrop 0.05 differs from resid_pdrop 0.2" in err and "embd_pdrop 0.1 is not applied" in err
    args = build_parser().parse_args(["train", "--init-from-hf", str(tmp_path / "src"), "--set", "model.seq_len=16",
                                      "--set", "model.dropout=0"])
    cfg = resolve_config(args)
    assert cfg.model.dropout == 0.0
    check_before_launch(cfg, make_out_dir=False)  # a training setting, not the checkpoint's shape
