"""A tokenizer's document markers, read from its own files as ``transformers`` reads them.

``bos``: the token ``transformers``' tokenizer puts before a text it encodes. Where
``tokenizer_config.json`` sets ``add_bos_token`` or ``add_eos_token``, the tokenizer is
rebuilt from them (``bos_token`` before the text where ``add_bos_token`` is true); otherwise
``tokenizer.json``'s post-processor decides (Llama 3's ``TemplateProcessing`` puts
``<|begin_of_text|>`` first; Qwen's ``ByteLevel`` adds nothing).

``eos``: the tokenizer's ``eos_token`` (``tokenizer_config.json``, else
``special_tokens_map.json``; a string or an ``AddedToken`` dict), which training appends to
each document and completion, as TRL's ``SFTTrainer`` appends ``eos_token``.

A tokenizer trained by xlafit (:func:`xlafit.data.clm.train_bpe`) declares its ``<s>``,
``</s>`` and ``<pad>`` in these files too; one written before it did (a ``tokenizer.json``
alone, those three tokens at ids 0, 1, 2) is read as it trained: ``<s>`` first, ``</s>`` last.

Example:
    >>> from tokenizers import models
    >>> tok = Tokenizer(models.WordLevel({"<bos>": 0, "<eos>": 1, "[UNK]": 2}, unk_token="[UNK]"))
    >>> markers(tok, {"bos_token": "<bos>", "eos_token": {"content": "<eos>"}, "add_bos_token": True})
    (0, 1)
"""

from __future__ import annotations

import json
from typing import Any

from tokenizers import Tokenizer

from xlafit.io.paths import as_path

__all__ = ["TRAINED_HERE", "first_added", "markers", "settings", "token_name"]

TRAINED_HERE = ("<s>", "</s>", "<pad>")  # a tokenizer xlafit trains: its bos, eos and pad at ids 0, 1, 2
_FILES = ("special_tokens_map.json", "tokenizer_config.json")  # the later names a token over the earlier


def settings(folder: Any) -> dict[str, Any] | None:
    """``tokenizer_config.json``'s settings over ``special_tokens_map.json``'s, of the
    tokenizer in ``folder`` (a directory or a ``tokenizer.json`` in one; local or a URL);
    None where it has neither file. A flag (``add_bos_token``) is only ever the config's."""
    root = as_path(folder)
    if str(root).endswith(".json"):
        root = root.parent
    read = [json.loads((root / n).read_text()) if (root / n).exists() else None for n in _FILES]
    if read == [None, None]:
        return None
    mapping, config = (r or {} for r in read)
    return {**{k: v for k, v in mapping.items() if k.endswith("_token")}, **config}


def token_name(value: Any) -> str | None:
    """A special token as the files give it: a string, or an ``AddedToken`` dict (``content``)."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def markers(tok: Tokenizer, config: dict[str, Any] | None) -> tuple[int | None, int | None]:
    """``(bos, eos)`` ids of ``tok`` with the settings ``config`` (:func:`settings`), as the
    module docstring says; None where it has none."""
    if config is None:
        return _trained_here(tok)
    name = token_name(config.get("eos_token"))
    eos = tok.token_to_id(name) if name else None
    if "add_bos_token" in config or "add_eos_token" in config:  # transformers rebuilds its post-processor from them
        bos_name = token_name(config.get("bos_token")) if config.get("add_bos_token") else None
        return (tok.token_to_id(bos_name) if bos_name else None), eos
    return first_added(tok), eos


def first_added(tok: Tokenizer) -> int | None:
    """The special token ``tok``'s post-processor (``tokenizer.json``'s) puts before a text."""
    return _leading(json.loads(tok.to_str()).get("post_processor"))


def _leading(processor: dict[str, Any] | None) -> int | None:
    """The special token a ``tokenizer.json`` post-processor puts before a single text."""
    if not processor:
        return None
    kind = processor.get("type")
    if kind == "Sequence":
        return next((b for p in processor.get("processors", []) if (b := _leading(p)) is not None), None)
    if kind in ("BertProcessing", "RobertaProcessing"):
        return int(processor["cls"][1])
    if kind == "TemplateProcessing":
        for piece in processor.get("single", []):
            if "Sequence" in piece:
                return None
            if "SpecialToken" in piece:
                ids = processor["special_tokens"][piece["SpecialToken"]["id"]]["ids"]
                return int(ids[0]) if ids else None
    return None


def _trained_here(tok: Tokenizer) -> tuple[int | None, int | None]:
    """A ``tokenizer.json`` with no settings beside it: xlafit's own (its three special
    tokens at ids 0, 1, 2) is read as it trained; any other declares no markers."""
    added = {i: t.content for i, t in tok.get_added_tokens_decoder().items()}
    if added == dict(enumerate(TRAINED_HERE)):
        return 0, 1
    return None, None
