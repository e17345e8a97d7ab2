"""Export a run for the Hugging Face ecosystem: python -m boost_jax.export --run runs/x --out DIR

DIR receives model.safetensors and config.json (boost_jax/hf.py says which names and layouts;
arch=full and arch=svd load as transformers' LlamaForCausalLM), and the run's tokenizer.json
with a tokenizer_config.json when the run used one (a byte-tokenized run has no file: its ids
are the UTF-8 bytes, EOS is byte 0). `model.init_from=DIR` starts a run from it. DIR is written
whole into a temporary folder and renamed, so an existing DIR (replaced only with --force) is
never left half-written.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile

from boost_jax.cli import Parser
from boost_jax.errors import UserError, cli_main


def parse_args(argv=None):
    p = Parser(prog="python -m boost_jax.export", description=__doc__)
    p.add_argument("--run", required=True, help="the training run's out_dir, e.g. runs/demo")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    p.add_argument("--out", required=True, help="the folder to write")
    p.add_argument("--force", action="store_true", help="replace --out if it exists")
    return p.parse_args(argv)


def tokenizer_files(run, dest: str) -> dict:
    """Copy the run's tokenizer.json (if any) into dest; the config.json fields that say so."""
    tok = run.tokenizer
    info = {"tokenizer": run.cfg.data.tokenizer if tok.fingerprint == "byte" else
            "tokenizer.json", "tokenizer_fingerprint": tok.fingerprint}
    if tok.fingerprint == "byte":
        return info
    import json

    tok._tok.save(os.path.join(dest, "tokenizer.json"))
    eos = tok._tok.id_to_token(tok.eos_id)
    with open(os.path.join(dest, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos,
                   "bos_token": eos, "model_max_length": run.cfg.model.max_seq_len,
                   "clean_up_tokenization_spaces": False}, f, indent=2)
    return info


def export(run_dir: str, out: str, step=None, force: bool = False) -> list[str]:
    from boost_jax import hf
    from boost_jax.infer.load import open_run

    if os.path.exists(out) and not force:
        raise UserError(f"--out {out!r} already exists; pass --force to replace it, or choose "
                        "another folder")
    run = open_run(run_dir, step)
    parent = os.path.dirname(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".export-", dir=parent)
    try:
        info = tokenizer_files(run, tmp)
        info.update(run=run.path, step=run.step)
        eos = {"bos_token_id": int(run.tokenizer.eos_id), "eos_token_id": int(run.tokenizer.eos_id)}
        files = hf.write(tmp, run.cfg.model, run.params, info, eos)
        if os.path.exists(out):
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return sorted(os.listdir(out)) if files else []


@cli_main
def main(argv=None):
    args = parse_args(argv)
    from boost_jax.infer.load import quiet_libraries

    quiet_libraries()
    files = export(args.run, args.out, args.step, args.force)
    print(f"wrote {args.out}: {', '.join(files)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
