"""The default main job, exactly as the README runs it, through torchx local_cwd;
then the CLI's ckpt ls/verify and export, and the exported adapter loaded with peft and its
tokenizer, generating as the README shows."""

from __future__ import annotations

import math
import os
import re
import stat

import pytest
import torch

from elastic_ft.runevents.events import read_events
from elastic_ft.checkpoint.filemode import default_file_mode
from elastic_ft.train.model import byte_tokenizer
from tests.conftest import BIN, REPO, cli, explain, run

pytestmark = [pytest.mark.slow, pytest.mark.torchrun]


@pytest.fixture(scope="module")
def main_job(tmp_path_factory):
    """The README's command with no component arguments, in a scratch working directory
    that sees the repo's specs/ and data/: the embedded defaults decide everything."""
    cwd = tmp_path_factory.mktemp("main")
    for name in ("specs", "data"):
        os.symlink(os.path.join(REPO, name), cwd / name)
    proc = run([os.path.join(BIN, "torchx"), "run", "-s", "local_cwd", "elastic_ft.train"], timeout=600, cwd=str(cwd))
    assert proc.returncode == 0, explain(proc)
    root = cwd / "runs"  # checkpoint_uri default file://./runs, run_id default: the spec's name
    return root, read_events(str(root / "tiny-lora" / "logs" / "events.jsonl")), proc.stdout + proc.stderr


def test_default_job_completes_with_two_ranks_and_learns(main_job):
    _root, events, _ = main_job
    start = next(e for e in events if e["event"] == "start")
    assert start["world"] == 2 and start["total_steps"] == 100
    steps = [e for e in events if e["event"] == "step"]
    assert [e["step"] for e in steps] == list(range(1, 101))
    first, last = steps[0]["loss"], steps[-1]["loss"]
    # Well below a uniform guess over the vocabulary (ln 259 = 5.56), where the first step starts:
    # the job visibly learns (it once ended at 4.70, barely under the guess).
    uniform = math.log(len(byte_tokenizer()))
    assert abs(first - uniform) < 0.5 and last < 0.4 * uniform, f"loss went from {first} to {last} (uniform {uniform})"
    committed = [e["step"] for e in events if e["event"] == "checkpoint_committed"]
    assert committed == [20, 40, 60, 80, 100]
    assert events[-1]["event"] == "end" and events[-1]["step"] == 100


def test_console_shows_progress_lines_not_json(main_job):
    _root, _, console = main_job
    assert "step 100/100 | loss" in console and "start: attempt 1 of run tiny-lora, world 2" in console
    assert '{"ts"' not in console, "raw JSON events reached the console (they belong in events.jsonl)"
    # Nothing the user cannot act on: library warnings, torchrun's OMP_NUM_THREADS banner, progress bars.
    for noise in ("Warning", "warnings.warn", "OMP_NUM_THREADS", "it/s]"):
        assert noise not in console, f"{noise!r} on the console:\n{console}"


def test_ckpt_ls_and_verify(main_job):
    root, _, _ = main_job
    uri = f"file://{root}/tiny-lora"
    ls = cli("ckpt", "ls", uri)
    assert ls.returncode == 0, explain(ls)
    listed = [line.split()[0] for line in ls.stdout.splitlines()[1:]]
    assert listed == ["60", "80", "100"], ls.stdout  # keep_last: 3
    verify = cli("ckpt", "verify", uri)
    assert verify.returncode == 0, explain(verify)
    assert "step 100 OK" in verify.stdout


def test_export_loads_with_peft_and_has_trained_lora(main_job, tmp_path):
    from peft import AutoPeftModelForCausalLM, PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root, _, _ = main_job
    out = tmp_path / "adapter"
    proc = cli("export", f"file://{root}/tiny-lora", "--out", str(out))
    assert proc.returncode == 0, explain(proc)
    assert (out / "adapter_config.json").is_file() and (out / "adapter_model.safetensors").is_file()
    # Readable as any file the user writes (safetensors alone would leave the weights 0600).
    for written in ("adapter_model.safetensors", "adapter_config.json", "base/model.safetensors"):
        assert stat.S_IMODE(os.stat(out / written).st_mode) == default_file_mode(), written
    base = AutoModelForCausalLM.from_pretrained(str(out / "base"))
    tokenizer = AutoTokenizer.from_pretrained(str(out / "base"))
    model = PeftModel.from_pretrained(base, str(out))
    lora_b = {n: p for n, p in model.named_parameters() if "lora_B" in n}
    assert lora_b, "no LoRA B matrices in the loaded adapter"
    assert all(p.abs().sum() > 0 for p in lora_b.values()), "a LoRA B matrix is still zero: not trained"
    # The loaded adapter changes the model's output: it is wired in, not just present.
    ids = tokenizer("What is 12 plus 30?", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        tuned = model(input_ids=ids).logits
        with model.disable_adapter():
            plain = model(input_ids=ids).logits
    assert not torch.allclose(tuned, plain)
    generates_the_form_of_the_training_data(AutoTokenizer.from_pretrained(str(out)),
                                            AutoPeftModelForCausalLM.from_pretrained(str(out)))


# The corpus's four templates (data/make_tiny_corpus.py): a prompt and the form of its answer.
FORMS = [("What is 12 plus 30?", r" \d+\."), ("Add 25 and 41.", r" The sum is \d+\."), ("47 + 38 =", r" \d+"),
         ("Compute the sum of 19 and 23.", r" \d+ \+ \d+ = \d+\.")]


def generates_the_form_of_the_training_data(tokenizer, model) -> None:
    """The README's generation: the tokenizer beside the adapter puts BOS first as training did, and
    greedy answers take the form of the corpus's answers (a random model's are noise)."""
    ids = tokenizer(FORMS[0][0])["input_ids"]
    assert ids == [tokenizer.bos_token_id] + tokenizer(FORMS[0][0], add_special_tokens=False)["input_ids"]
    answers = []
    for prompt, _ in FORMS:
        batch = tokenizer(prompt, return_tensors="pt")
        out = model.generate(**batch, max_new_tokens=24, do_sample=False)
        answers.append(tokenizer.decode(out[0, batch["input_ids"].shape[1]:], skip_special_tokens=True))
    matched = [bool(re.fullmatch(form, a)) for (_, form), a in zip(FORMS, answers)]
    assert sum(matched) >= 3, list(zip([p for p, _ in FORMS], answers))
