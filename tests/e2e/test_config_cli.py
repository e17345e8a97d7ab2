"""train.py's config handling from the command line: one-line errors, the printed config."""

import subprocess
import sys

from train_proc import ROOT


def test_cli_error_is_one_line_exit_2():
    r = subprocess.run([sys.executable, f"{ROOT}/train.py", "--config", f"{ROOT}/configs/demo.yaml",
                        "train.stesp=3"], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 2
    assert r.stderr.strip() == "error: unknown config key 'train.stesp'; did you mean 'train.steps'?"


def _printed_vocab(*overrides):
    r = subprocess.run([sys.executable, f"{ROOT}/train.py", "--print-config", *overrides],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    model = r.stdout.split("model:", 1)[1]
    return int(model.split("vocab_size:", 1)[1].split()[0])


def test_vocab_size_follows_the_tokenizer_unless_set(tmp_path):
    from tokenizers import Tokenizer, models

    path = tmp_path / "wl.json"
    Tokenizer(models.WordLevel({f"w{i}": i for i in range(300)}, unk_token="w0")).save(str(path))
    assert _printed_vocab() == 256  # byte
    assert _printed_vocab("data.tokenizer=bpe") == 4096
    assert _printed_vocab("data.tokenizer=bpe", "data.bpe_vocab_size=1000") == 1024
    # 300 words + the EOS added for a tokenizer without one, rounded up to a multiple of 128
    assert _printed_vocab(f"data.tokenizer={path}") == 384
    assert _printed_vocab("data.tokenizer=bpe", "model.vocab_size=5000") == 5000
