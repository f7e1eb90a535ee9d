"""Chat data: conversations rendered with the tokenizer's chat template, only the assistant turns trained.

A record's ``data.messages_field`` holds a conversation as in the OpenAI and
Hugging Face chat format: a list of ``{"role", "content"}`` objects, roles
:data:`~elastic_ft.train.datafiles.ROLES`, content text. It is rendered whole with the tokenizer's chat
template (``apply_chat_template``; the template owns every token, BOS and
end-of-turn tokens included) and tokenized once; a token is trained when it
overlaps an assistant turn's trained span: the turn's content and its
end-of-turn text, not its role header (as TRL and axolotl do).

How the spans are found (:func:`encode_conversations`):

- a template with ``{% generation %}`` blocks marks them itself: transformers'
  ``return_assistant_tokens_mask`` (the template author's choice of tokens;
  what TRL's ``assistant_only_loss`` requires, and why TRL ships patched
  training templates for the model families whose templates lack them);
- any other template: by rendering prefixes (:func:`assistant_spans`; the
  property TRL's ``is_chat_template_prefix_preserving`` checks). Turn ``i``'s
  span runs from the end of the conversation before it rendered with the
  generation prompt (the assistant header) to the end of the conversation
  through it. Each such rendering must be a prefix of the whole rendering; a
  template that renders an earlier turn differently once later turns follow
  (one that drops earlier reasoning, say) fails that check, and the record is
  refused naming it, rather than trained on guessed spans. The span then
  includes what the template writes between the turn's end-of-turn token and
  the next turn (ChatML's newline).

Both ways map character spans to tokens by the fast tokenizer's offsets with
the same rule (a token overlapping a span is trained), so they agree on a
template that has both.

Cost: one template rendering per conversation and one tokenizer call per
batch; the prefix way renders a conversation once more per assistant turn
(quadratic in its turns, which stay few). Measured on the tiny chat corpus
(about 100 tokens a conversation), one process of the loaded 2-core machine:
about 2,500 conversations/s (250k tokens/s) with generation blocks, 850/s by
prefixes (a call per conversation with generation blocks: about 1,600/s).
Runs once per run, in the store's build.
"""

from __future__ import annotations

import re

from elastic_ft.train.datafiles import DataError

_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")
"""A ``{% generation %}`` tag (jinja whitespace control allowed): the template marks its trained tokens."""


def template_text(tokenizer, field: str) -> str:
    """The tokenizer's chat template; :class:`DataError` naming ``data.messages_field`` if it has none."""
    template = None
    try:
        template = tokenizer.get_chat_template()
    except (ValueError, AttributeError):
        pass
    if not isinstance(template, str) or not template:
        raise DataError(f"data.messages_field {field!r}: the tokenizer has no chat template to render the "
                        f"conversations with; use a tokenizer that has one (model.tokenizer, e.g. an instruct "
                        f"model's) or train on data.prompt_field/response_field")
    if not getattr(tokenizer, "is_fast", False):
        raise DataError(f"data.messages_field {field!r}: the tokenizer {type(tokenizer).__name__} is not a fast "
                        f"tokenizer, and the assistant turns are found by its character offsets; use its fast version")
    return template


def has_generation_blocks(template: str) -> bool:
    return bool(_GENERATION.search(template))


class ConversationError(ValueError):
    """A conversation that the template cannot render, or whose assistant turns cannot be found; ``index``
    is its place in the batch given (None while unknown)."""

    def __init__(self, message: str, index: int | None = None) -> None:
        super().__init__(message)
        self.index = index


def _render(tokenizer, template: str, messages: list, *, add_generation_prompt: bool = False) -> str:
    try:
        return tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                             add_generation_prompt=add_generation_prompt)
    except Exception as exc:  # jinja's raise_exception, a missing key: the template's own words
        raise ConversationError(f"the chat template cannot render it: {exc}") from exc


def assistant_spans(tokenizer, template: str, messages: list) -> tuple[str, list[tuple[int, int]]]:
    """The whole rendering of ``messages`` and the character spans of its assistant turns, found by rendering
    prefixes (for templates without ``{% generation %}`` blocks); :class:`ConversationError` when a prefix is
    not rendered as a prefix of the whole."""
    full = _render(tokenizer, template, messages)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        if i == 0:
            raise ConversationError("it opens with an assistant turn, whose header cannot be told from its "
                                    "content without {% generation %} blocks in the chat template")
        before = _render(tokenizer, template, messages[:i], add_generation_prompt=True)
        after = _render(tokenizer, template, messages[:i + 1])
        if not (full.startswith(after) and after.startswith(before)):
            raise ConversationError(f"the chat template renders the conversation up to message {i + 1} "
                                    f"differently from the start of the whole, so the assistant turns cannot be "
                                    f"found; use a template with {{% generation %}} blocks around them")
        if len(after) > len(before):
            spans.append((len(before), len(after)))
    return full, spans


def span_mask(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[int]:
    """1 for each token (by its character ``offsets``) that overlaps one of ``spans``, else 0 (transformers' rule
    for ``return_assistant_tokens_mask``: a token cut by a span's edge is trained)."""
    mask = [0] * len(offsets)
    k = 0
    for t, (start, end) in enumerate(offsets):
        while k < len(spans) and start >= spans[k][1]:
            k += 1
        if k == len(spans):
            break
        if end > spans[k][0]:
            mask[t] = 1
    return mask


def encode_conversations(tokenizer, template: str,
                         conversations: list[list]) -> tuple[list[list[int]], list[list[int]]]:
    """Token ids of each rendered conversation and a 0/1 trained mark per token (assistant turns only).

    One batched call where the template has generation blocks (rendering and the fast tokenizer's threads
    over the whole batch: about 5 times the speed of a call per conversation); a batch the template refuses is
    rendered again one conversation at a time, to name the one. :class:`ConversationError` carries its index.
    """
    if has_generation_blocks(template):
        try:
            out = tokenizer.apply_chat_template(conversations, chat_template=template, tokenize=True,
                                                return_dict=True, return_assistant_tokens_mask=True)
        except Exception:
            for k, messages in enumerate(conversations):
                try:
                    _render(tokenizer, template, messages)
                except ConversationError as exc:
                    exc.index = k
                    raise
            raise  # each renders alone: not one conversation's fault, so no record to name
        return [list(ids) for ids in out["input_ids"]], [list(mask) for mask in out["assistant_masks"]]
    texts, spans = [], []
    for k, messages in enumerate(conversations):
        try:
            text, found = assistant_spans(tokenizer, template, messages)
        except ConversationError as exc:
            exc.index = k
            raise
        texts.append(text)
        spans.append(found)
    enc = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
    return ([list(ids) for ids in enc["input_ids"]],
            [span_mask(offsets, found) for offsets, found in zip(enc["offset_mapping"], spans)])


__all__ = ["ConversationError", "assistant_spans", "encode_conversations", "has_generation_blocks", "span_mask",
           "template_text"]
