"""A tokenizer's document markers, read from its own files as ``transformers`` reads them.

``bos``: the token ``transformers``' tokenizer puts before a text it encodes, which is what
``tokenizer.json``'s post-processor puts there (Gemma's and Llama 3's ``TemplateProcessing``
put ``<bos>`` and ``<|begin_of_text|>`` first; Qwen's ``ByteLevel`` adds nothing). Where
there is a ``tokenizer.json``, ``transformers`` builds the tokenizer from it and sets aside
``tokenizer_config.json``'s ``add_bos_token`` and ``add_eos_token`` (a hub model's files
agree with each other).

``eos``: the tokenizer's ``eos_token`` (``tokenizer_config.json``, else
``special_tokens_map.json``; a string or an ``AddedToken`` dict), which training appends to
each document and completion, as TRL's ``SFTTrainer`` appends ``eos_token``.

A tokenizer trained by xlafit (:func:`xlafit.data.clm.train_bpe`) declares its ``<s>``,
``</s>`` and ``<pad>`` in these files too; one written before it did (those three tokens at
ids 0, 1, 2, a post-processor that adds nothing, no ``eos_token`` beside it) is read as it
trained: ``<s>`` first, ``</s>`` last.

Example:
    >>> from tokenizers import models, processors
    >>> tok = Tokenizer(models.WordLevel({"<bos>": 0, "<eos>": 1, "[UNK]": 2}, unk_token="[UNK]"))
    >>> tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 0)])
    >>> markers(tok, {"bos_token": "<bos>", "eos_token": {"content": "<eos>"}})
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
    name = token_name((config or {}).get("eos_token"))
    eos = tok.token_to_id(name) if name else None
    bos = first_added(tok)
    if bos is None and _older_xlafit(tok):
        return 0, (1 if eos is None else eos)
    return bos, eos


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


def _older_xlafit(tok: Tokenizer) -> bool:
    """Whether ``tok`` is a tokenizer of xlafit's from before its files declared its markers:
    its added tokens are :data:`TRAINED_HERE` at ids 0, 1, 2 and nothing else."""
    added = {i: t.content for i, t in tok.get_added_tokens_decoder().items()}
    return added == dict(enumerate(TRAINED_HERE))
