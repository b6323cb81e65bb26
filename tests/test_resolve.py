"""A run is resolved once (train/resolve.py): the data source's kind, its token-file header, its
tokenizer and vocabulary are each decided once and then asked of the resolved run; the mesh and the
strategies are described in the order they are applied."""

from __future__ import annotations

import shardlab.data.tokenfile as tokenfile
import shardlab.train.corpus as corpus
from shardlab.data.prepare import prepare
from shardlab.train.config import load_config
from shardlab.train.corpus import load_corpus
from shardlab.train.corpus_checks import check_token_ids
from shardlab.train.resolve import resolve_run

TINY = ["model.n_layer=1", "model.d_model=32", "model.n_head=2", "model.seq_len=8", "train.global_batch=4"]


def test_a_token_files_header_is_read_once_for_every_question(tmp_path, monkeypatch):
    text = tmp_path / "corpus.txt"
    text.write_text("def f(x):\n    return x + 1\n" * 50)
    tok = tmp_path / "corpus.tok"
    prepare([str(text)], tok, "bytes", workers=1, progress=False, log=lambda m: None)
    reads = []
    real = tokenfile.read_header
    for module in (tokenfile, corpus):  # the header's readers: the file's own module and the trainer's
        monkeypatch.setattr(module, "read_header", lambda path: reads.append(path) or real(path))

    run = resolve_run(load_config(None, [*TINY, f'data.source="{tok}"']))
    assert run.data is not None and run.data.kind == "tokens" and run.data.path == tok
    assert run.vocab == 256  # the header's 256 ids, padded to a multiple of 64: itself
    model = run.build_model()
    task = run.build_task(model)  # the ids mapped, the header's id check, the tokenizer, bytes per token
    check_token_ids(run.data, run.vocab, load_corpus(run.data, 8, split=True))
    h = run.data.header
    assert task.bytes_per_token == h.text_bytes / h.count and task.tokenizer is run.data.tokenizer
    assert reads == [tok]


def test_the_mlp_has_no_data_and_the_strategies_come_in_the_order_they_are_applied():
    mlp = resolve_run(load_config(None, ["model.name=mlp", "model.n_layer=4", "model.d_model=16"]))
    assert mlp.data is None and mlp.vocab == 0 and mlp.world_size == 1
    run = resolve_run(load_config(None, [*TINY, "model.n_layer=2", "layout.pp=2", "layout.tp=2", "layout.sp=true",
                                         "layout.dp=2", "layout.zero=1", "train.micro_batches=2"]))
    # Described in parallelize's one order (tests/test_layout_steps.py pins it): tp before the cut into stages.
    assert run.strategies == ("tp 2 + sp (megatron)", "pp 2 (1f1b)", "dp 2 (ZeRO-1)")
    assert dict(run.mesh_shape) == {"pp": 2, "dp": 2, "ep": 1, "cp": 1, "tp": 2} and run.world_size == 8
    assert run.vocab == 256 and run.precision == "fp32"


def test_the_users_configuration_is_unchanged_by_a_run(pools, tmp_path):
    """What the data decides (the vocabulary, the token file text is encoded into, the tokenizer that
    reads it) is the resolved run's: the Config the user passed stays as written through resolution,
    data preparation, the trip to the ranks and the run itself (train/corpus.py wrote data.source,
    data.tokenizer and data.max_bytes into it, and the launcher model.vocab_size)."""
    import copy
    import math
    import pickle
    import tomllib

    from shardlab.data.tokenizer import train_bpe
    from shardlab.train.loop import train_rank

    text = "".join(f"def function_{i}(value):\n    return value * {i} + len('text {i}')\n\n" for i in range(60))
    (tmp_path / "a.txt").write_text(text)
    tok = train_bpe([text], 300, tmp_path / "bpe.json")
    cfg = load_config(None, [*TINY, f'data.source="{tmp_path / "a.txt"}"', f'data.tokenizer="{tok.path}"',
                             "data.max_bytes=100000", f'data.cache_dir="{tmp_path / "cache"}"', "train.steps=2",
                             "train.warmup_steps=1", "train.eval_every=0", "train.eval_batches=1",
                             "log.sample_tokens=0", "log.plot=false", "log.tensorboard=false", "log.memory=false",
                             f'log.out_dir="{tmp_path / "run"}"'])
    cfg.validate()
    before = copy.deepcopy(cfg.to_dict())
    run = resolve_run(cfg).prepared(progress=False)  # what `shardlab train` does before launch
    d = run.config.data
    assert d.source.endswith(".tok") and (d.tokenizer, d.max_bytes) == ("", 0) and run.data.kind == "tokens"
    assert run.model.vocab_size == run.vocab == 320  # the tokenizer's 300 ids padded to a multiple of 64
    assert pickle.loads(pickle.dumps(run)).config.to_dict() == run.config.to_dict()  # what the ranks receive
    summary = pools(1).run(train_rank, run)[0]
    assert math.isfinite(summary["final_loss"])
    assert cfg.to_dict() == before
    # The run records the configuration as resolved, as before: the token file it read, the vocabulary.
    recorded = tomllib.loads((tmp_path / "run" / "config.toml").read_text())
    assert recorded["data"]["source"] == d.source and recorded["model"]["vocab_size"] == 320
