"""The trainer and its data: vocabulary from a token file's header (padded as Megatron does), a
GPT-2-sized vocabulary trained end to end, sampling through the corpus's tokenizer, and ids past the
model's vocabulary refused before launch, naming the id and the file."""

from __future__ import annotations

import numpy as np

from shardlab.cli.main import main
from shardlab.train.config import load_config
from shardlab.train.corpus import padded_vocab

TEXT = "".join(f"def function_{i}(value):\n    return value * {i} + len('text {i}')\n\n" for i in range(60))


def test_padded_vocab_is_a_multiple_of_64_and_tp():
    assert padded_vocab(256) == 256 and padded_vocab(256, 8) == 256
    assert padded_vocab(50257) == 50304 and padded_vocab(50257, 3) == 50304  # 262 x lcm(64, 3) = 192
    assert padded_vocab(256, 3) == 384 and padded_vocab(4096, 2) == 4096


def _gpt2_sized_tokenizer(path):
    """A byte-level BPE with GPT-2's shape: 256 byte symbols, 50,000 merges, <|endoftext|> = 50256.
    Made here (GPT-2's own file would be a download): the merges are pairs of byte symbols."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    merges = []
    for a in alphabet:
        for b in alphabet:
            if len(merges) == 50_000:
                break
            merges.append((a, b))
            vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>"])
    tok.save(str(path))
    return path


def test_gpt2_vocabulary_prepared_and_trained(pools, tmp_path):
    from shardlab.cli.train import check_data_before_launch
    from shardlab.data.tokenfile import read_token_file
    from shardlab.train.loop import train_rank
    from shardlab.train.resolve import resolve_run

    tok = _gpt2_sized_tokenizer(tmp_path / "gpt2-shaped.json")
    (tmp_path / "a.txt").write_text(TEXT)
    (tmp_path / "b.txt").write_text(TEXT.upper())
    out = tmp_path / "gpt2.tok"
    assert main(["data", "prepare", str(tmp_path / "*.txt"), "--tokenizer", str(tok), "--out", str(out),
                 "--workers", "1", "--no-progress"]) == 0
    tf = read_token_file(out)
    assert (tf.header.vocab_size, tf.header.eot, tf.header.dtype) == (50257, 50256, "uint16")
    assert int(tf.tokens.max()) == 50256 and int(tf.tokens[tf.documents[1] - 1]) == 50256

    cfg = load_config(None, [
        "model.n_layer=1", "model.d_model=32", "model.n_head=2", "model.seq_len=16", "train.global_batch=4",
        "train.steps=3", "train.warmup_steps=1", "train.log_every=1", "train.eval_every=0", "train.eval_batches=1",
        f'data.source="{out}"', "log.memory=false", "log.tensorboard=false", "log.plot=false",
        "log.sample_tokens=6", 'log.sample_prompt="def"', f'log.out_dir="{tmp_path / "run"}"'])
    cfg.validate()
    run = check_data_before_launch(resolve_run(cfg))  # what `shardlab train` does before launch
    assert run.model.vocab_size == 50304  # 50,257 padded to a multiple of 64
    summary = pools(1).run(train_rank, run)[0]
    assert summary["final_loss"] < summary["first_loss"]
    # Sampled through the same tokenizer: text, not ids, and never a padded id (it would not decode).
    assert summary["sample"].startswith("def") and len(summary["sample"]) > 6
    assert summary["final_val_bits_per_byte"] > 0 and summary["final_val_perplexity"] > 1


def test_dry_run_takes_the_vocabulary_from_the_header(tmp_path, capsys):
    from shardlab.data.prepare import prepare

    (tmp_path / "a.txt").write_text(TEXT)
    out = prepare([str(tmp_path / "a.txt")], tmp_path / "d" / "a.tok", train_bpe=300, workers=1, progress=False).out
    # A short window: --dry-run checks the data too, and this file holds a few hundred tokens.
    assert main(["train", "--set", f'data.source="{out}"', "--tp", "3", "--set", "model.n_head=3",
                 "--set", "model.d_model=48", "--set", "model.seq_len=8", "--dry-run"]) == 0
    assert "vocab_size = 384" in capsys.readouterr().out  # <= 300 ids padded to lcm(64, tp 3) = 192's multiple


def test_ids_past_the_vocabulary_are_refused_before_launch(tmp_path, capsys):
    ids = np.arange(400, dtype=np.uint16) % 900
    ids[123] = 1500
    raw = tmp_path / "nanogpt-train.bin"
    ids.tofile(raw)
    # A raw uint16 file stated to hold a 1,000-id vocabulary: id 1500 is named with its file and position.
    args = ["train", "--set", f'data.source="{raw}"', "--set", "data.vocab_size=1000", "--set", "model.seq_len=8",
            "--set", "log.sample_tokens=0", "--set", f'log.out_dir="{tmp_path / "run"}"']
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "nanogpt-train.bin: token id 1500 at position 123" in err and "data.vocab_size = 1,000" in err
    # Without a stated vocabulary a uint16 file is refused too: raw ids cannot say their vocabulary.
    assert main([*args[:3], "--set", 'data.token_dtype="uint16"', *args[5:]]) == 2
    assert "set data.vocab_size" in capsys.readouterr().err
    # A model smaller than a token file's header says.
    from shardlab.data.prepare import prepare

    (tmp_path / "a.txt").write_text(TEXT)
    tok_file = prepare([str(tmp_path / "a.txt")], tmp_path / "a.tok", train_bpe=300, workers=1, progress=False).out
    assert main(["train", "--set", f'data.source="{tok_file}"', "--set", "model.vocab_size=256", "--dry-run"]) == 2
    assert "model.vocab_size = 256 is smaller than the data's vocabulary" in capsys.readouterr().err
    # A sample needs a tokenizer: raw ids of a vocabulary past bytes name none.
    ok = np.arange(400, dtype=np.uint16) % 900
    ok.tofile(raw)
    assert main([*args[:-4], *args[-2:]]) == 2  # log.sample_tokens left at its default
    assert "names no tokenizer" in capsys.readouterr().err


def test_a_corpus_too_small_for_the_windows_is_refused_before_launch(tmp_path, capsys):
    """Too few tokens for a window in both splits used to pass every check and fail in each rank after
    the launch, with a traceback per rank; it is refused first, naming the fields that decide it."""
    from shardlab.data.prepare import prepare

    (tmp_path / "a.txt").write_text("hi there\n")
    tok_file = prepare([str(tmp_path / "a.txt")], tmp_path / "a.tok", workers=1, progress=False).out
    run = ["--set", "log.sample_tokens=0", "--set", f'log.out_dir="{tmp_path / "run"}"']
    assert main(["train", "--set", f'data.source="{tok_file}"', *run]) == 2
    err = capsys.readouterr().err
    assert f"data.source = '{tok_file}' holds 12 tokens, fewer than the" in err and "model.seq_len = " in err, err
    assert "Traceback" not in err
    # A cap on the text read says so.
    assert main(["train", "--set", "data.max_bytes=100", *run]) == 2
    assert "holds 100 tokens (read up to data.max_bytes = 100)" in capsys.readouterr().err
