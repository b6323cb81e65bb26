"""`shardlab generate` and `shardlab --version`: a checkpoint read back into the plain model continues a
prompt as the model itself does; the sampler's greedy, top-k and top-p choices; clear refusals."""

from __future__ import annotations

from importlib.metadata import version

import pytest
import torch

from shardlab.checkpoint import save_checkpoint
from shardlab.cli.main import main
from shardlab.data.tokenizer import ByteTokenizer
from shardlab.train.config import load_config
from shardlab.train.generate import GenerateError, load_for_generation
from shardlab.train.sample import next_token
from shardlab.train.task import build_model

SMALL = ["model.n_layer=2", "model.d_model=32", "model.n_head=4", "model.seq_len=24", "model.vocab_size=320"]


def test_version_is_the_distributions(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"shardlab {version('shardlab')}"


def _saved_run(tmp_path, extra=()):
    """A byte-level GPT with random weights saved as step 5 of a run under tmp_path/run."""
    cfg = load_config(None, [*SMALL, *extra, f'log.out_dir="{tmp_path / "run"}"'])
    torch.manual_seed(3)
    model = build_model(cfg.model)
    save_checkpoint(tmp_path / "run" / "checkpoints", 5, model, config=cfg.to_dict())
    return cfg, model


def _greedy(model, ids, n, vocab, seq_len):
    """The reference: argmax of the model's own logits, one token at a time."""
    ids = list(ids)
    with torch.no_grad():
        for _ in range(n):
            logits = model.eval()(torch.tensor([ids[-seq_len:]]))[0, -1, :vocab]
            ids.append(int(logits.argmax()))
    return ids


def test_generate_from_a_checkpoint_continues_as_the_model(tmp_path, capsys):
    cfg, model = _saved_run(tmp_path)
    loaded = load_for_generation(tmp_path / "run")  # the run directory: its newest checkpoint
    assert isinstance(loaded.tokenizer, ByteTokenizer) and loaded.seq_len == 24
    prompt = list(b"def f(x):")
    # 20 new tokens past a 9-token prompt: the window slides past the 24-token context.
    want = _greedy(model, prompt, 20, 256, 24)
    assert loaded.generate_ids(prompt, 20, temperature=0) == want
    assert main(["generate", str(tmp_path / "run" / "checkpoints" / "step_00000005"), "--prompt", "def f(x):",
                 "--tokens", "20", "--temperature", "0"]) == 0
    captured = capsys.readouterr()
    assert captured.out.rstrip("\n") == ByteTokenizer().decode(want)
    assert "step 5" in captured.err and "exceed the context" in captured.err
    # Sampling: the seed decides; ids past the tokenizer's 256 (the padded rows) are never drawn.
    a = loaded.generate_ids(prompt, 30, temperature=1.5, top_k=0, seed=1)
    assert a == loaded.generate_ids(prompt, 30, temperature=1.5, top_k=0, seed=1)
    assert a != loaded.generate_ids(prompt, 30, temperature=1.5, top_k=0, seed=2)
    assert max(a) < 256


def test_next_token_greedy_top_k_and_top_p():
    gen = torch.Generator().manual_seed(0)
    probs = torch.tensor([[0.1, 0.5, 0.3, 0.1]])
    logits = probs.log()
    assert next_token(logits, 0, 0, 1.0, gen).item() == 1
    draws = {next_token(logits, 1.0, 0, 0.7, gen).item() for _ in range(200)}
    assert draws == {1, 2}  # 0.5 + 0.3 reach 0.7: the nucleus is ids 1 and 2
    draws = {next_token(logits, 1.0, 2, 1.0, gen).item() for _ in range(200)}
    assert draws == {1, 2}  # the two most likely
    assert {next_token(logits, 1.0, 0, 0.4, gen).item() for _ in range(50)} == {1}  # the first alone reaches 0.4
    assert {next_token(logits, 1.0, 0, 1.0, gen).item() for _ in range(400)} == {0, 1, 2, 3}


def test_generate_refuses_with_the_reason(tmp_path, capsys):
    assert main(["generate", str(tmp_path / "nothing")]) == 1
    assert "no such file or directory" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["generate", str(tmp_path / "empty")]) == 1
    assert "neither a checkpoint nor a directory holding one" in capsys.readouterr().err
    assert main(["generate", str(tmp_path), "--top-p", "0"]) == 2
    assert "--top-p 0.0: must be in (0.0, 1.0]" in capsys.readouterr().err
    raw = tmp_path / "ids.bin"
    raw.write_bytes(bytes(range(256)) * 4)
    _saved_run(tmp_path, [f'data.source="{raw}"', "data.vocab_size=300"])
    with pytest.raises(GenerateError, match="raw ids .* name no tokenizer: give --tokenizer"):
        load_for_generation(tmp_path / "run")
    assert isinstance(load_for_generation(tmp_path / "run", tokenizer="bytes").tokenizer, ByteTokenizer)


@pytest.mark.parametrize("layout", [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_generate_under_tensor_or_pipeline_parallelism_continues_alike(pools, tmp_path, layout):
    """The checkpoint resharded into tp 2 or pp 2 over 2 ranks continues a prompt greedily as one
    process does. The ranks sum the same products in another order (tp) or the same order (pp): the
    logits differ by ~1e-6 at most, so the argmax can differ only where the two best logits are that
    close; the reference's smallest gap on this path is checked to be far above it."""
    from shardlab.train.generate import generate_rank, layout_plan

    _, model = _saved_run(tmp_path, ["model.n_layer=4"])
    prompt = list(b"def f(x):")
    want = _greedy(model, prompt, 12, 256, 24)
    with torch.no_grad():
        gaps = [torch.topk(model(torch.tensor([want[:i][-24:]]))[0, -1, :256], 2).values for i in
                range(len(prompt), len(want))]
    assert min(float(g[0] - g[1]) for g in gaps) > 1e-3
    ckpt, cfg, tok, _ = layout_plan(tmp_path / "run", None, *layout)
    assert (cfg.layout.tp, cfg.layout.pp) == layout
    got = pools(2).run(generate_rank, ckpt, cfg.to_dict(), prompt, 12, tok.vocab_size, 0.0, 0, 1.0, 0)
    assert got[0] == want and got[1] is None


def test_a_layout_the_model_cannot_take_is_refused(tmp_path, capsys):
    _saved_run(tmp_path)  # 4 heads, 2 layers
    assert main(["generate", str(tmp_path / "run"), "--tp", "3"]) == 2
    assert "--tp 3 --pp 1: invalid configuration" in capsys.readouterr().err
