"""Export a run for the Hugging Face ecosystem: python -m boost_jax.export --run runs/x --out DIR

DIR receives model.safetensors and config.json (boost_jax/hf.py says which names and layouts;
arch=full and arch=svd load as transformers' LlamaForCausalLM), and the run's tokenizer.json
with a tokenizer_config.json when the run used one (a byte-tokenized run has no file: its ids
are the UTF-8 bytes, EOS is byte 0), and a generation_config.json when model.vocab_size pads
the embedding past the tokenizer's ids (generate() must not pick those). `model.init_from=DIR`
starts a run from it. DIR is written whole into a temporary folder and renamed
(boost_jax/safe_write.py), so it is never half-written. An existing DIR is replaced only with
--force and only if it is empty or an earlier export exactly as written, as its manifest proves
(export_manifest.py); DIR may never be the run, hold it or lie inside it, nor be anything but
a folder.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from typing import Optional

from boost_jax.cli import Parser
from boost_jax.errors import UserError, cli_main

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
GENERATION_FILE = "generation_config.json"  # only for a padded embedding (generation_config)


def parse_args(argv=None):
    p = Parser(prog="python -m boost_jax.export", description=__doc__)
    p.add_argument("--run", required=True, help="the training run's out_dir, e.g. runs/demo")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    p.add_argument("--out", required=True, help="the folder to write")
    p.add_argument("--force", action="store_true", help="replace --out if it is an earlier export")
    return p.parse_args(argv)


def tokenizer_files(run, dest: str) -> dict:
    """Copy the run's tokenizer.json (if any) into dest; the config.json fields that say so."""
    tok = run.tokenizer
    info = {"tokenizer": run.cfg.data.tokenizer if tok.fingerprint == "byte" else
            "tokenizer.json", "tokenizer_fingerprint": tok.fingerprint}
    if tok.fingerprint == "byte":
        return info
    tok._tok.save(os.path.join(dest, TOKENIZER_FILES[0]))
    eos = tok._tok.id_to_token(tok.eos_id)
    with open(os.path.join(dest, TOKENIZER_FILES[1]), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos,
                   "bos_token": eos, "model_max_length": run.cfg.model.max_seq_len,
                   "clean_up_tokenization_spaces": False}, f, indent=2)
    return info


def generation_config(n_ids: int, vocab_size: int, eos: int) -> Optional[dict]:
    """generation_config.json for an embedding with rows past the tokenizer's ids
    (model.vocab_size above its size): transformers' generate() then never picks them, as
    boost_jax's own decoding does not; None when there are none."""
    if vocab_size <= n_ids:
        return None
    return {"bos_token_id": eos, "eos_token_id": eos, "pad_token_id": eos,
            "suppress_tokens": list(range(n_ids, vocab_size))}


def _check_out(run_dir: str, out: str, force: bool) -> None:
    """safe_write's rule for --out: never the run, a folder holding it or a folder inside it
    (even with --force); an existing --out only with --force, and only an earlier export."""
    from boost_jax.export_manifest import not_ours
    from boost_jax.safe_write import Refused, refuse_existing, refuse_inputs, refuse_special, \
        refuse_unusable

    what = f"--out {out!r}"
    refuse_unusable(out, what, "name a folder, e.g. hf/NAME", folder=True,
                    config_value=True)  # model.init_from names it
    refuse_inputs(out, {"the run": run_dir}, what, "choose a folder outside the run, e.g. "
                  "hf/NAME")
    refuse_special(out, what, "choose another folder", folder=True)
    refuse_existing([out], force, "choose another folder", what)
    if not os.path.lexists(out):
        return
    if os.path.islink(out) or not os.path.isdir(out):
        raise Refused(f"{what} is a file or a link, not an earlier export; --force replaces "
                      "only an export folder: choose another folder, or remove it")
    if not os.listdir(out):  # an empty folder: --force loses nothing
        return
    why = not_ours(out)
    if why:
        raise Refused(f"{what} {why}; --force replaces only an earlier export left as it was "
                      "written: choose another folder, or move its files away")


def export(run_dir: str, out: str, step=None, force: bool = False) -> list[str]:
    from boost_jax.data.tokenizers import tokenizer_file
    from boost_jax.infer.load import open_run
    from boost_jax.safe_write import exclusive, refuse_inputs

    _check_out(run_dir, out, force)
    run = open_run(run_dir, step)
    refuse_inputs(out, {"data.tokenizer": tokenizer_file(run.cfg.data.tokenizer, run_dir)},
                  f"--out {out!r}", "choose another folder")  # read to export it: an input
    try:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    except (FileExistsError, NotADirectoryError):  # makedirs met a file on the way
        raise UserError(f"cannot write --out {out!r}: a folder above it is a file; choose a "
                        "folder in a writable place") from None
    except OSError as e:
        raise UserError(f"cannot write --out {out!r} ({e.strerror}); choose a folder in a "
                        "writable place") from None
    # one export at a time per --out; the temp folder a killed one left is removed
    try:
        with exclusive([out], f"--out {out!r}", "choose another folder"):
            return _write(run, out, force)
    except OSError as e:  # its lock file could not be made
        raise UserError(f"cannot write --out {out!r} ({e.strerror}); choose a folder in a "
                        "writable place") from None


def _write(run, out: str, force: bool) -> list[str]:
    """Build the export in a temp folder beside `out` and publish it whole."""
    from safetensors import SafetensorError

    from boost_jax import hf
    from boost_jax.export_manifest import write_manifest
    from boost_jax.safe_write import publish_dir, staged_dir

    try:
        tmp = staged_dir(out)
    except OSError as e:
        raise UserError(f"cannot write --out {out!r} ({e.strerror}); choose a folder in a "
                        "writable place") from None
    try:
        info = tokenizer_files(run, tmp)
        info.update(run=run.path, step=run.step)
        eos = {"bos_token_id": int(run.tokenizer.eos_id), "eos_token_id": int(run.tokenizer.eos_id)}
        hf.write(tmp, run.cfg.model, run.params, info, eos)
        gen = generation_config(int(run.tokenizer.vocab_size), run.cfg.model.vocab_size,
                                int(run.tokenizer.eos_id))
        if gen:
            with open(os.path.join(tmp, GENERATION_FILE), "w") as f:
                json.dump(gen, f, indent=2)
        write_manifest(tmp)
        files = sorted(os.listdir(tmp))
        publish_dir(tmp, out, replace=force)
    except (OSError, SafetensorError) as e:
        why = getattr(e, "strerror", None) or str(e).splitlines()[0]
        raise UserError(f"writing --out {out!r} failed ({why}); nothing was published: free "
                        "space or choose another folder") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return files


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
