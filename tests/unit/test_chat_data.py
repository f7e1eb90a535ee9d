"""Chat data (``data.messages_field``) through the token store, in this process: the assistant turns and
nothing else are trained, token by token, with the byte tokenizer's template (generation blocks) and with
the same template found by rendering prefixes; truncation; the store's identity follows the field and the
template; every bad conversation, a tokenizer without a template and a spec mixing kinds of samples are
one line naming the field and the record's line."""

from __future__ import annotations

import json
import re

import pytest

from elastic_ft.config import DataConfig, JobSpec, ModelConfig, validate
from elastic_ft.train import data as data_mod
from elastic_ft.train.model import BYTE_CHAT_TEMPLATE, byte_tokenizer
from elastic_ft.train.token_store import IGNORE
from tests.conftest import REPO

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2 plus 3?"},
    {"role": "assistant", "content": "5."},
    {"role": "user", "content": "And plus 4?"},
    {"role": "assistant", "content": "That makes 9."},
]
BAD_LINE = 51

WITHOUT_GENERATION_BLOCKS = re.sub(r"\{%-? *(end)?generation *-?%\}", "", BYTE_CHAT_TEMPLATE)
"""The byte template with its generation markers taken out: its assistant turns are found by rendering prefixes."""


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    """A node cache of the test's own (the token store's node copies live under it)."""
    monkeypatch.setenv("ELASTIC_FT_INPUT_CACHE", str(tmp_path / "node-cache"))


def tokenizer(template: str = BYTE_CHAT_TEMPLATE):
    tok = byte_tokenizer()
    tok.chat_template = template
    return tok


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def load(path: str, tok=None, *, field: str = "messages", max_length: int = 256):
    return data_mod.load(DataConfig(files=[path], messages_field=field, max_length=max_length), tok or tokenizer())


def expected(tok, messages) -> tuple[list[int], list[int]]:
    """The rendering of ``messages`` built piece by piece, each piece tokenized on its own (a byte tokenizer
    has no merges), with its trained mark: BOS, then per turn a ``<|role|>`` header line (never trained),
    the content and EOS (trained in assistant turns only)."""
    ids, marks = [tok.bos_token_id], [0]
    for m in messages:
        header = tok(f"<|{m['role']}|>\n", add_special_tokens=False)["input_ids"]
        body = tok(m["content"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        trained = int(m["role"] == "assistant")
        ids += header + body
        marks += [0] * len(header) + [trained] * len(body)
    return ids, marks


@pytest.mark.parametrize("template", [BYTE_CHAT_TEMPLATE, WITHOUT_GENERATION_BLOCKS],
                         ids=["generation-blocks", "prefix-rendering"])
def test_only_the_assistant_turns_are_trained_token_by_token(tmp_path, template):
    tok = tokenizer(template)
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATION}])
    store = load(path, tok)
    ids, trained = store.sample(0)
    want_ids, want_marks = expected(tok, CONVERSATION)
    assert ids.tolist() == want_ids
    assert trained.tolist() == want_marks
    # Both assistant turns, their EOS included, and nothing else; the labels the trainer gets follow.
    assert tok.decode(ids[trained.astype(bool)]) == "5.</s>That makes 9.</s>"
    labels = store.batch([0])["labels"][0, :len(want_ids)].tolist()
    assert labels == [t if m else IGNORE for t, m in zip(want_ids, want_marks)]
    assert store.target_count([0]) == sum(want_marks)  # the first position is never a target


def test_a_conversation_is_cut_at_max_length_with_its_marks(tmp_path):
    tok = tokenizer()
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATION}])
    want_ids, want_marks = expected(tok, CONVERSATION)
    cut = len(want_ids) - 8  # inside the second assistant turn
    ids, trained = load(path, tok, max_length=cut).sample(0)
    assert ids.tolist() == want_ids[:cut] and trained.tolist() == want_marks[:cut]


def test_both_ways_train_every_assistant_turn_of_the_tiny_chat_corpus():
    rows = [json.loads(line) for line in open(f"{REPO}/data/tiny-chat.jsonl")]
    assert len(rows) >= 24 and any(r["messages"][0]["role"] == "system" for r in rows)
    assert any(sum(m["role"] == "assistant" for m in r["messages"]) >= 3 for r in rows)
    cfg = dict(files=[f"{REPO}/data/tiny-chat.jsonl"], messages_field="messages", max_length=256)
    marked = data_mod.load(DataConfig(**cfg), tokenizer())
    found = data_mod.load(DataConfig(**cfg), tokenizer(WITHOUT_GENERATION_BLOCKS))
    tok = tokenizer()
    for i, row in enumerate(rows):
        want_ids, want_marks = expected(tok, row["messages"])
        for store in (marked, found):
            ids, trained = store.sample(i)
            assert ids.tolist() == want_ids and trained.tolist() == want_marks, i


def test_a_template_that_renders_a_prefix_differently_is_refused_naming_the_line(tmp_path):
    # Marks the last message: a prefix of the conversation then is not a prefix of the whole rendering.
    last = "('[last]' if loop.last else '') + "
    template = WITHOUT_GENERATION_BLOCKS.replace("{{- '<|' + message", "{{- " + last + "'<|' + message")
    header = "'<|assistant|>\\n' }}{{ message"
    template = template.replace("{{- " + header, "{{- " + last + header)
    assert template.count("[last]") == 2
    rows = [{"messages": CONVERSATION[1:3]}] * 3 + [{"messages": CONVERSATION}]
    path = write_jsonl(tmp_path / "chat.jsonl", rows)
    with pytest.raises(data_mod.DataError) as info:
        load(path, tokenizer(template))
    message = str(info.value)
    assert message.startswith("data.files[0]:1: field 'messages': the chat template renders the conversation up "
                              "to message 2 differently"), message
    assert "\n" not in message


def test_identity_follows_the_messages_field_and_the_template(tmp_path):
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATION, "chat": CONVERSATION}] * 4)
    cfg = DataConfig(files=[path], messages_field="messages", max_length=256)
    _, first = data_mod.load_with_report(cfg, tokenizer())
    _, again = data_mod.load_with_report(cfg, tokenizer())
    assert first.built and not again.built and again.identity == first.identity
    other_field = DataConfig(files=[path], messages_field="chat", max_length=256)
    _, by_field = data_mod.load_with_report(other_field, tokenizer())
    # The same tokens, but another setting (a field, a template that differs by a comment): a new store each.
    _, by_template = data_mod.load_with_report(cfg, tokenizer("{# v2 #}" + BYTE_CHAT_TEMPLATE))
    assert len({first.identity, by_field.identity, by_template.identity}) == 3
    assert by_field.built and by_template.built


GOOD = {"messages": CONVERSATION}


def corpus(tmp_path, bad: dict) -> str:
    """60 good conversations, line 51 replaced by ``bad``."""
    rows = [GOOD] * 60
    rows[BAD_LINE - 1] = bad
    return write_jsonl(tmp_path / "chat.jsonl", rows)


def turns(*messages) -> dict:
    return {"messages": list(messages)}


USER = {"role": "user", "content": "hi"}
ASSISTANT = {"role": "assistant", "content": "hello"}


@pytest.mark.parametrize("bad, problem", [
    (turns({"content": "hi"}, ASSISTANT),
     "field 'messages' message 1 has no 'role' (one of system, user, assistant, tool)"),
    (turns({"role": "human", "content": "hi"}, ASSISTANT), "field 'messages' message 1 has role 'human', not one of"),
    (turns(USER, {"role": "assistant", "content": None}),
     "field 'messages' message 2 has 'content' that is null, not text"),
    (turns(USER, {"role": "assistant", "content": [{"type": "text", "text": "x"}]}),
     "field 'messages' message 2 has 'content' that is an array, not text"),
    (turns(USER, {"role": "assistant"}), "field 'messages' message 2 has no 'content'"),
    (turns(USER, "hello"), "field 'messages' message 2 is a string, not an object with 'role' and 'content'"),
    (turns({"role": "system", "content": "s"}, USER), "field 'messages' has no assistant turn"),
    (turns(), "field 'messages' is an empty list"),
    ({"messages": "hello"}, "field 'messages' is a string, not a list of messages"),
    ({"messages": {"role": "user", "content": "hi"}}, "field 'messages' is an object, not a list of messages"),
    ({"chat": [USER, ASSISTANT]}, "no field 'messages' (data.messages_field); the record has ['chat']"),
])
def test_a_bad_conversation_is_one_line_naming_the_field_and_line(tmp_path, bad, problem):
    path = corpus(tmp_path, bad)
    with pytest.raises(data_mod.DataError) as info:
        load(path)
    message = str(info.value)
    assert message.startswith(f"data.files[0]:{BAD_LINE}: {problem}"), message
    assert path in message and "\n" not in message


REFUSES_TOOL_FIRST = ("{%- if messages[0]['role'] == 'tool' %}{{ raise_exception('no tool first') }}{%- endif %}"
                      + BYTE_CHAT_TEMPLATE)


def test_a_template_error_names_the_line(tmp_path):
    # The template's own refusal (jinja's raise_exception), found while tokenizing: still the line, not a record index.
    template = REFUSES_TOOL_FIRST
    path = corpus(tmp_path, turns({"role": "tool", "content": "{}"}, USER, ASSISTANT))
    with open(path, "a") as f:
        f.write("\n\n")  # blank lines do not count as records, nor shift the line numbers
    lines = open(path).read().splitlines()
    lines.insert(3, "")
    open(path, "w").write("\n".join(lines) + "\n")
    with pytest.raises(data_mod.DataError) as info:
        load(path, tokenizer(template))
    message = str(info.value)
    assert message.startswith(f"data.files[0]:{BAD_LINE + 1}: field 'messages': the chat template cannot render it: "
                              f"no tool first"), message
    assert "\n" not in message


def test_a_bad_parquet_row_is_named_by_its_row(tmp_path):
    import datasets

    path = str(tmp_path / "chat.parquet")
    no_assistant = [{"role": "user", "content": "hi"}, {"role": "user", "content": "again"}]
    datasets.Dataset.from_dict({"messages": [CONVERSATION[1:3], no_assistant, CONVERSATION[1:3]]}).to_parquet(path)
    with pytest.raises(data_mod.DataError) as info:
        load(path)
    assert str(info.value) == ("data record 2: field 'messages' has no assistant turn, so nothing in it would be "
                               "trained; fix or remove that record")
    # Good rows of a parquet file (a column of lists of structs) load as the JSON Lines do.
    datasets.Dataset.from_dict({"messages": [CONVERSATION]}).to_parquet(path)
    assert load(path).sample(0)[0].tolist() == expected(tokenizer(), CONVERSATION)[0]


def test_a_tokenizer_without_a_chat_template_is_one_line(tmp_path):
    tok = byte_tokenizer()
    tok.chat_template = None
    path = write_jsonl(tmp_path / "chat.jsonl", [GOOD])
    with pytest.raises(data_mod.DataError) as info:
        load(path, tok)
    message = str(info.value)
    assert message.startswith("data.messages_field 'messages': the tokenizer has no chat template"), message
    assert "\n" not in message


@pytest.mark.parametrize("fields, named", [
    ({"prompt_field": "q", "response_field": "a"}, "data.prompt_field and data.response_field"),
    ({"text_field": "body"}, "data.text_field"),
])
def test_chat_data_with_another_kind_of_sample_is_one_problem(fields, named):
    spec = JobSpec(model=ModelConfig(config={"model_type": "llama"}), steps=1,
                   data=DataConfig(files=["x.jsonl"], messages_field="messages", **fields))
    problems = [(f, m) for f, m in validate(spec, check_files=False) if f.startswith("data")]
    assert problems == [("data.messages_field", f"chat data cannot be combined with {named}; set either "
                                                f"messages_field or those")]


def test_the_messages_field_is_part_of_the_config_hash():
    # A checkpoint of a run trained on one field must not resume a run of another.
    def spec(**data):
        return JobSpec(model=ModelConfig(config={"model_type": "llama"}), steps=1,
                       data=DataConfig(files=["x.jsonl"], **data))
    assert spec(messages_field="messages").hash() != spec(messages_field="chat").hash()
    assert spec(messages_field="messages").hash() != spec().hash()


def test_a_saved_byte_tokenizer_keeps_its_chat_template(tmp_path):
    # The exported model's tokenizer renders conversations as training did.
    from transformers import AutoTokenizer

    byte_tokenizer().save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded.apply_chat_template(CONVERSATION, return_dict=True)["input_ids"] == expected(loaded, CONVERSATION)[0]


CHATML = ("{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n' }}{%- endfor %}"
          "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
"""ChatML as Qwen and many others ship it (no generation blocks), its markers as plain text here."""


def test_a_chatml_template_trains_each_assistant_turn_through_its_end_of_turn(tmp_path):
    # Prefix rendering: a turn's span ends where the next turn begins, so the newline after <|im_end|> is in it.
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATION}])
    tok = tokenizer(CHATML)
    ids, trained = load(path, tok).sample(0)
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in CONVERSATION)
    assert tok.decode(ids) == text
    runs, current = [], []
    for token, mark in zip(ids.tolist(), trained.tolist()):
        if mark:
            current.append(token)
        elif current:
            runs, current = runs + [current], []
    runs += [current] if current else []
    assert [tok.decode(run) for run in runs] == ["5.<|im_end|>\n", "That makes 9.<|im_end|>\n"]


def test_a_rank_names_the_line_of_a_record_in_its_own_share(tmp_path):
    # A rank tokenizes records lo..hi-1 only: the line it names is the file's, not its place in the share.
    from elastic_ft.train.token_records import Records, tokenize_share
    from elastic_ft.train.token_store import token_dtype

    template = REFUSES_TOOL_FIRST
    path = corpus(tmp_path, turns({"role": "tool", "content": "{}"}, USER, ASSISTANT))
    cfg = DataConfig(files=[path], messages_field="messages", max_length=256)
    records = Records(cfg, "json")
    tok = tokenizer(template)
    tokenize_share(records, 0, 30, cfg, tok, token_dtype(len(tok)), str(tmp_path / "part-0"))  # no bad record
    with pytest.raises(data_mod.DataError, match=rf"^data.files\[0\]:{BAD_LINE}: field 'messages': the chat "
                                                 rf"template cannot render it: no tool first; fix or remove"):
        tokenize_share(records, 30, 60, cfg, tok, token_dtype(len(tok)), str(tmp_path / "part-1"))


def test_packed_conversations_are_cut_at_max_length_and_packed_whole(cache):
    """With ``data.packing`` a conversation longer than ``max_length`` is cut like any sample (rows take whole
    samples of at most ``max_length`` tokens), its marks with it; every conversation is in one row."""
    cfg = DataConfig(files=[f"{REPO}/data/tiny-chat.jsonl"], messages_field="messages", max_length=64, packing=True)
    store = data_mod.load(cfg, tokenizer())
    assert store.packed
    lengths = [len(store.sample(i)[0]) for i in range(store.header.samples)]
    assert max(lengths) == 64 and store.header.samples == 48  # the corpus runs 37 .. 183 tokens a conversation
    rows = sorted(int(s) for r in range(len(store)) for s in store.samples_of([r])[0])
    assert rows == list(range(48))
