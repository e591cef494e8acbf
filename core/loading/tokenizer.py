"""Text <-> token ids, chat templates and streaming detokenization.

One ``Tokenizer`` type serves both checkpoint formats: HF folders bring a
``tokenizer.json`` (plus config files around it), GGUF files bring vocabulary
metadata that :mod:`lmplug.loading.gguf_vocab` turns into the same backend.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from functools import cached_property, lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenizers import Tokenizer as Backend

from lmplug.errors import ModelLoadError

if TYPE_CHECKING:  # jinja2 and the sandbox load on the first chat template rendered, not with tokenizers
    import jinja2

    from lmplug.loading.chat_template import ChatEncoder, ChatTemplateError

__all__ = ["ChatTemplateError", "IncrementalDetokenizer", "Tokenizer"]


def __getattr__(name: str) -> Any:
    if name == "ChatTemplateError":  # re-exported from the chat template module, imported on use
        from lmplug.loading.chat_template import ChatTemplateError

        return ChatTemplateError
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class Tokenizer:
    """A ``tokenizers`` backend plus what the model's config says about BOS, EOS and chat."""

    def __init__(
        self,
        backend: Backend,
        *,
        name: str,
        add_bos_token: bool = False,
        bos_token: str | None = None,
        eos_token: str | None = None,
        bos_token_id: int | None = None,
        special_tokens: Mapping[str, str] | None = None,
        extra_eos_token_ids: Iterable[int] = (),
        chat_template: str | None = None,
    ) -> None:
        self.backend = backend
        self.name = name
        self.add_bos_token = add_bos_token
        self.bos_token = bos_token
        self.eos_token = eos_token
        # GGUF states the id outright; an HF folder only names the token.
        if bos_token_id is None and bos_token is not None:
            bos_token_id = backend.token_to_id(bos_token)
        self._bos_token_id = bos_token_id
        # Everything the chat template may refer to: bos_token, eos_token, unk_token, pad_token.
        self.special_tokens = {k: v for k, v in (special_tokens or {}).items() if v is not None}
        self.special_tokens.update(
            {k: v for k, v in (("bos_token", bos_token), ("eos_token", eos_token)) if v is not None}
        )
        eos_ids = set(extra_eos_token_ids)
        if eos_token is not None and (eos_id := backend.token_to_id(eos_token)) is not None:
            eos_ids.add(eos_id)
        self._eos_token_ids = frozenset(eos_ids)
        self._chat_template = chat_template
        # True: special-token text in message content becomes control tokens (unsafe with
        # untrusted clients: a user could forge a system turn); False: it stays plain text.
        self.allow_special_in_content = False
        # True (an encoder's tokenizer: the engine build sets it): ``encode`` adds what tokenizer.json's
        # post-processor adds, BERT's [CLS] ... [SEP], as sentence-transformers encodes a text
        self.post_process = False

    # -- construction -----------------------------------------------------------------

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer:
        """Load ``tokenizer.json`` and the config files HF keeps beside it."""
        path = Path(path)
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ModelLoadError(
                f"{tokenizer_file}: not found (an HF model folder needs tokenizer.json)"
            )
        try:
            backend = Backend.from_file(str(tokenizer_file))
        except Exception as e:  # tokenizers raises a bare Exception on bad JSON
            raise ModelLoadError(f"{tokenizer_file}: not a valid tokenizers JSON file: {e}") from e
        config = _read_json(path / "tokenizer_config.json")
        bos, eos = _token_text(config.get("bos_token")), _token_text(config.get("eos_token"))
        add_bos = config.get("add_bos_token")
        if add_bos is None:
            add_bos = _post_processor_adds_bos(backend, bos)
        return cls(
            backend,
            name=path.name,
            add_bos_token=bool(add_bos),
            bos_token=bos,
            eos_token=eos,
            special_tokens={k: _token_text(config.get(k)) for k in ("unk_token", "pad_token")},
            extra_eos_token_ids=_config_eos_ids(path),
            chat_template=_hf_chat_template(path, config),
        )

    @classmethod
    def from_gguf(cls, metadata: Mapping[str, Any], name: str) -> Tokenizer:
        """Build from decoded GGUF metadata (``{key: field.contents()}``)."""
        from lmplug.loading.gguf_vocab import build_backend

        backend, add_bos_default = build_backend(metadata, name)
        tokens = metadata["tokenizer.ggml.tokens"]

        def token(key: str) -> str | None:
            index = metadata.get(f"tokenizer.ggml.{key}")
            return tokens[index] if index is not None and 0 <= index < len(tokens) else None

        # llama.cpp also stops on end-of-turn / end-of-message tokens when a vocab names them.
        extra_eos = [
            metadata[f"tokenizer.ggml.{k}"]
            for k in ("eos_token_id", "eot_token_id", "eom_token_id")
            if f"tokenizer.ggml.{k}" in metadata
        ]
        return cls(
            backend,
            name=name,
            add_bos_token=bool(metadata.get("tokenizer.ggml.add_bos_token", add_bos_default)),
            bos_token=token("bos_token_id"),
            eos_token=token("eos_token_id"),
            bos_token_id=metadata.get("tokenizer.ggml.bos_token_id"),
            special_tokens={
                "unk_token": token("unknown_token_id"),
                "pad_token": token("padding_token_id"),
            },
            extra_eos_token_ids=extra_eos,
            chat_template=metadata.get("tokenizer.chat_template"),
        )

    # -- properties -------------------------------------------------------------------

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Every id that ends generation."""
        return self._eos_token_ids

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_token_id

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def chat_template(self) -> str | None:
        return self._chat_template

    # -- encode / decode --------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids for ``text``; BOS is prepended only when the model's config asks for it (an
        encoder's: the post-processor's special tokens, ``post_process``)."""
        if self.post_process:
            return self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        ids = self.backend.encode(text, add_special_tokens=False).ids
        bos_id = self.bos_token_id
        if add_special_tokens and self.add_bos_token and bos_id is not None:
            ids.insert(0, bos_id)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, **extra: Any
    ) -> str:
        """Render ``messages`` with the model's jinja chat template, as HF transformers does."""
        variables = {"tools": None, "documents": None, **self.special_tokens, **extra}
        return self._render(messages, add_generation_prompt, variables)

    def chat_ids(
        self, messages: list[dict], add_generation_prompt: bool = True,
        allow_special_in_content: bool | None = None, **extra: Any
    ) -> list[int]:
        """Token ids of the rendered chat (no BOS added: the template writes its own).

        Special-token text in messages, tools and documents is encoded as plain text,
        unless ``allow_special_in_content`` (default: the attribute of that name) is set;
        the special tokens the template itself writes are special ids either way.
        """
        allow = self.allow_special_in_content if allow_special_in_content is None else allow_special_in_content
        if allow:
            return self.encode(self.apply_chat_template(messages, add_generation_prompt, **extra),
                               add_special_tokens=False)
        enc = self._chat_encoder
        variables = {"tools": None, "documents": None, **self.special_tokens,
                     **{k: enc.escape(v) for k, v in extra.items()}}
        return enc.encode(self._render(enc.escape(messages), add_generation_prompt, variables))

    @cached_property
    def _chat_encoder(self) -> ChatEncoder:
        from lmplug.loading.chat_template import ChatEncoder

        return ChatEncoder(self.backend)

    def _render(self, messages: Any, add_generation_prompt: bool, variables: dict) -> str:
        if not self._chat_template:
            raise ModelLoadError(
                f"model {self.name!r} has no chat template; use plain-text prompts instead"
            )
        import jinja2

        from lmplug.loading.chat_template import render

        try:
            template = _compile_template(self._chat_template)
        except jinja2.TemplateSyntaxError as e:
            raise ModelLoadError(
                f"model {self.name!r}: chat template is not valid jinja (line {e.lineno}): {e}"
            ) from e
        variables = {**variables, "messages": messages, "add_generation_prompt": add_generation_prompt}
        return render(template, self.name, variables)


class IncrementalDetokenizer:
    """Turns a growing list of generated ids into text deltas for streaming.

    Decoding one token at a time is wrong for two reasons: a character may span
    several byte-level tokens (a lone piece decodes to U+FFFD), and decoders that
    look at neighbours (SentencePiece's leading space) need context. So we decode a
    short window ``ids[prefix_offset:]`` and emit what it adds beyond
    ``ids[prefix_offset:read_offset]``, holding back a trailing U+FFFD (a character
    still missing bytes). Offsets only advance once the window ends cleanly; text
    before the held-back bytes is emitted at once (several ids may arrive per step).
    """

    _CONTEXT = 5  # prompt tokens kept as decoding context

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: Sequence[int], skip_special_tokens: bool = True
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._ids = list(prompt_ids)
        self._num_prompt = len(self._ids)
        self._read_offset = len(self._ids)
        self._prefix_offset = max(self._read_offset - self._CONTEXT, 0)
        self._emitted_past_read = 0  # chars already emitted from an unfinished window
        self._text = ""

    @property
    def text(self) -> str:
        """All output text emitted so far (the concatenation of the deltas)."""
        return self._text

    @property
    def output_ids(self) -> list[int]:
        return self._ids[self._num_prompt :]

    def add(self, new_ids: Iterable[int]) -> str:
        """Append generated ids; return the text they complete (possibly "")."""
        self._ids.extend(new_ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """At the end of generation: emit what was held back, even an incomplete character."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        complete = final or not full.endswith("\ufffd")
        end = len(full) if complete else len(full.rstrip("\ufffd"))
        start = len(prefix) + self._emitted_past_read
        delta = full[start:end] if end > start else ""
        if complete and len(full) > len(prefix):
            self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
            self._emitted_past_read = 0
        else:
            self._emitted_past_read += len(delta)
        self._text += delta
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)


# -- HF folder helpers ----------------------------------------------------------------


def _read_json(path: Path, required: bool = False) -> dict:
    if not path.is_file():
        if required:
            raise ModelLoadError(f"{path}: not found")
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{path}: not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _token_text(value: Any) -> str | None:
    """Special tokens appear as plain strings or as serialized AddedToken dicts."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _post_processor_adds_bos(backend: Backend, bos: str | None) -> bool:
    # tokenizer_config.json may not say; then tokenizer.json's post-processor decides.
    bos_id = None if bos is None else backend.token_to_id(bos)
    if bos_id is None:
        return False
    ids = backend.encode("a", add_special_tokens=True).ids
    return bool(ids) and ids[0] == bos_id


def _config_eos_ids(path: Path) -> list[int]:
    ids: list[int] = []
    for name in ("generation_config.json", "config.json"):
        value = _read_json(path / name).get("eos_token_id")
        ids.extend(value if isinstance(value, list) else [] if value is None else [value])
    return [int(i) for i in ids]


def _hf_chat_template(path: Path, config: dict) -> str | None:
    """Newer HF folders keep the template in its own file, which then takes precedence."""
    jinja_file = path / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = _read_json(path / "chat_template.json").get("chat_template")
    if template is None:
        template = config.get("chat_template")
    if isinstance(template, list):  # [{name, template}, ...]: HF's default is named "default"
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    if template is not None and not isinstance(template, str):
        raise ModelLoadError(
            f"{path}: chat_template must be a string or a list of {{name, template}}"
        )
    return template


# -- chat template rendering ---------------------------------------------------------


@lru_cache(maxsize=16)
def _compile_template(source: str) -> jinja2.Template:
    from lmplug.loading.chat_template import compile_template

    return compile_template(source)
