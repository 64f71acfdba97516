"""The llm recipe's data wiring: its ``data`` section, the tokenizer and chat template a run
encodes with, the packed rows (:func:`load_data`), what they hold in words, and the files a
run keeps to read its model back (:func:`save_artifacts`). ``model.init_from_hf``'s
directory is found here too (:func:`model_dir`): its tokenizer is the default one.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import sys
import tempfile
from pathlib import Path
from typing import Any, Literal

from tokenizers import Tokenizer

from xlafit import config as xconfig
from xlafit.config import Config
from xlafit.data import chat, chat_demo, clm, files, rendering, special_tokens
from xlafit.data.preference import PAIR_FORMAT
from xlafit.data.prompts import PROMPT_FORMAT
from xlafit.data.text import korean_demo_files
from xlafit.errors import ConfigError
from xlafit.io import hub
from xlafit.io.cache import cache_dir
from xlafit.io.paths import as_path
from xlafit.models.attention import packed_segments_limit
from xlafit.recipes.base import reading_shapes_only
from xlafit.train import preference

log = logging.getLogger("xlafit")

DEMO_VOCAB_SIZE = 2000  # the demo's BPE tokenizer
DATA_FORMAT_FILE = "data_format.json"  # the format of the data a run trained on (chat, prompt_completion, text)
# model.init_from_hf's config.json as the run read it: a full fine-tune's checkpoints hold every
# weight, and with this they need nothing of the base (generate, export, eval after it moved)
BASE_CONFIG = "base_config.json"


@dataclasses.dataclass
class LlmDataConfig(xconfig.DataConfig):
    """``data_dir``: text files (documents separated by blank lines) or Parquet files, a file,
    directory, glob or URL (null: the Korean demo corpus)."""

    seq_len: int = 256  # tokens per packed row (documents longer than this are cut into pieces)
    # a Hugging Face tokenizer.json, or a directory holding one; null: model.init_from_hf's,
    # else (the demo) a byte-level BPE trained on the corpus
    tokenizer: str | None = None
    vocab_size: int | None = None  # the size of the BPE tokenizer the demo trains (null: 2000)
    text_column: str = "text"  # the column of Parquet files that holds the documents
    eval_fraction: float = 0.1  # documents held out for evaluation (a hash of their index and data.seed)
    # files to evaluate on, as data.data_dir names them, in place of data.eval_fraction (a folder of
    # data.data_dir with train-* and test-* or validation-* files evaluates on those without it)
    eval_data_dir: str | None = None
    # auto (from the records), text, chat ({"messages": [...]}), prompt_completion ({"prompt", "completion"})
    # preference ({"prompt", "chosen", "rejected"}: model.objective=dpo, simpo, orpo) or prompt ({"prompt"}
    # and any columns for the rewards: model.objective=grpo)
    format: str = "auto"
    # chat records: a Jinja chat template file instead of the tokenizer's (tokenizer_config.json's chat_template),
    # or one of xlafit's training templates by name (qwen3, mistral-v0.3; see xlafit/data/templates.py)
    chat_template: str | None = None
    loss_on: str = "assistant"  # chat and prompt/completion records: assistant (the answers only) or all
    # with no data.data_dir: korean (the konlpy wheel's texts), chat (arithmetic conversations with a ChatML
    # tokenizer), arithmetic (the same kind of questions and answers as plain text, the same tokenizer) or
    # preference (sums with a right answer chosen and a wrong one rejected: model.objective=dpo) or
    # grpo (the chat demo's questions as prompts, each with its answer: model.objective=grpo)
    demo: Literal["korean", "chat", "arithmetic", "preference", "grpo"] = "korean"

    def __post_init__(self) -> None:
        super().__post_init__()
        xconfig.check_fraction(self.eval_fraction, "data.eval_fraction")
        formats = ("auto", *chat.FORMATS, PAIR_FORMAT, PROMPT_FORMAT)
        if self.format not in formats:
            raise ConfigError(f"data.format={self.format}: give one of {', '.join(formats)}.")


def data_config(cfg: Config) -> LlmDataConfig:
    """``cfg.data`` as this recipe's :class:`LlmDataConfig` (its own keys typed)."""
    if not isinstance(cfg.data, LlmDataConfig):
        raise TypeError(f"an llm config has an LlmDataConfig, got {type(cfg.data).__name__}")
    return cfg.data


def model_dir(cfg: Config) -> str | None:
    """``model.init_from_hf`` as a local directory: a hub id downloaded into the Hugging Face
    cache first (:func:`xlafit.io.hub.resolve`; its configuration and tokenizer alone while a
    check reads shapes, :func:`~xlafit.recipes.base.shapes_only`); None when the model starts
    from scratch."""
    name = cfg.model.init_from_hf
    if not name:
        return None
    return _resolved(name, cfg.model.revision, "model.init_from_hf", not reading_shapes_only())


def recorded_model_dir(cfg: Config, run: Any) -> str | None:
    """:func:`model_dir` of a run's recorded config (``xlafit generate`` and ``export`` on
    ``run``), its error naming what a path recorded relative needs: the directory the run
    started in."""
    if not cfg.lora.rank and (as_path(run) / BASE_CONFIG).exists():  # the weights are all the checkpoint's
        return None
    try:
        return model_dir(cfg)
    except ConfigError as e:
        name = cfg.model.init_from_hf or ""
        if "://" in name:
            raise
        if name.startswith("~") or Path(name).is_absolute():  # moved or deleted since the run started
            raise ConfigError(
                f"{e} It is the model {run} started from (model.init_from_hf in {run}/config.yaml), which its "
                "checkpoints need (its config.json builds the model; a LoRA run's adapters apply to its weights): put "
                "it back there, or set model.init_from_hf in that file to where it is now."
            ) from None
        raise ConfigError(
            f"{e} {run}/config.yaml records model.init_from_hf={name} as it was given: if that is a directory "
            "relative to where the run started, run this command from that directory."
        ) from None


GENERATION_CONFIG = "generation_config.json"
# generation_config.json's settings that xlafit generate takes where not given, as transformers' generate does
SAMPLING_KEYS = ("do_sample", "temperature", "top_k", "top_p", "repetition_penalty", "max_new_tokens")
# Its settings that change transformers' tokens and that xlafit's generation does not apply, each
# with the value that leaves them off: a model whose config sets one is told so.
NOT_APPLIED = {
    "no_repeat_ngram_size": 0, "min_new_tokens": None, "min_length": 0, "min_p": None, "typical_p": 1.0,
    "epsilon_cutoff": 0.0, "eta_cutoff": 0.0, "num_beams": 1, "bad_words_ids": None, "suppress_tokens": None,
    "begin_suppress_tokens": None, "sequence_bias": None, "forced_bos_token_id": None, "forced_eos_token_id": None,
    "encoder_repetition_penalty": 1.0, "penalty_alpha": None, "guidance_scale": None,
}  # fmt: skip


def base_config(cfg: Config, run: Any) -> dict[str, Any]:
    """``model.init_from_hf``'s ``config.json`` as the run read it: the copy its ``run`` keeps
    (:data:`BASE_CONFIG`: no look at the base nor the hub), else the base's own (an older run).

    Raises:
        ConfigError: neither can be read (naming both).
    """
    snapshot = as_path(run) / BASE_CONFIG
    if snapshot.exists():
        return dict(json.loads(snapshot.read_text()))
    try:
        source = model_dir(cfg)
    except ConfigError as e:
        raise ConfigError(f"{e} ({run} keeps no copy of its config.json, {BASE_CONFIG}: an older run's).") from None
    return dict(json.loads((Path(str(source)).expanduser() / "config.json").read_text()))


def base_generation(cfg: Config, tokenizer_json: str) -> dict[str, Any]:
    """``model.init_from_hf``'s ``generation_config.json`` ({} where it has none), without its
    token ids where the run has another tokenizer (they would name other tokens); {} where the
    base is gone (a full fine-tune read again: its run recorded these settings)."""
    try:
        source = model_dir(cfg)
    except ConfigError:
        return {}
    base = Path(source).expanduser() if source else None
    if base is None or not (base / GENERATION_CONFIG).exists():
        return {}
    settings = json.loads((base / GENERATION_CONFIG).read_text())
    if not (base / "tokenizer.json").exists() or (base / "tokenizer.json").read_text() != tokenizer_json:
        settings = {k: v for k, v in settings.items() if k not in ("bos_token_id", "eos_token_id", "pad_token_id")}
    return settings


@functools.cache  # one look at the hub a process
def _resolved(name: str, revision: str | None, what: str, weights: bool = True) -> str:
    return hub.resolve(name, revision, what, weights)


def tokenizer_location(cfg: Config) -> str:
    """Where the run's ``tokenizer.json`` is: ``data.tokenizer`` (a hub id read from the
    Hugging Face cache), ``model.init_from_hf``'s, or the demo's BPE (trained once into the
    user cache)."""
    d = data_config(cfg)
    if d.tokenizer:
        return _resolved(d.tokenizer, cfg.model.revision, "data.tokenizer")
    source = model_dir(cfg)
    if source and (Path(source).expanduser() / "tokenizer.json").exists():
        return str(Path(source).expanduser())
    if not d.data_dir and d.demo in ("chat", "arithmetic", "preference", "grpo"):
        return chat_demo.demo_files()[2]
    if d.data_dir:
        raise ConfigError(
            "data.data_dir needs a tokenizer: set data.tokenizer (a tokenizer.json or a directory holding one), "
            "or model.init_from_hf to a directory that has one."
        )
    return demo_tokenizer(d.vocab_size or DEMO_VOCAB_SIZE)


def kept_tokenizer(cfg: Config) -> str | None:
    """The tokenizer a run keeps (``RUN/tokenizer``, :func:`save_artifacts`: its chat template
    as the run trained with it), where ``cfg`` is a run's and the folder has its
    ``tokenizer.json``; else None (:func:`tokenizer_location` says where it came from)."""
    if not cfg.run.run_dir:
        return None
    kept = as_path(cfg.run.run_dir) / "tokenizer"
    return str(kept) if (kept / "tokenizer.json").exists() else None


def demo_tokenizer(vocab_size: int) -> str:
    """The demo's byte-level BPE on the Korean corpus, trained once into the user cache."""
    texts = korean_demo_files()
    key = json.dumps(["bpe-2", texts, vocab_size])  # 2: its files declare its special tokens
    target = cache_dir() / f"llm-demo-tokenizer-{hashlib.sha256(key.encode()).hexdigest()[:12]}"
    if (target / "tokenizer.json").exists():
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        tok = clm.train_bpe(texts, vocab_size, tmp)
        print(
            f"trained the demo's BPE tokenizer ({tok.get_vocab_size()} tokens) into {target} (once)",
            file=sys.stderr,
            flush=True,
        )
        try:
            Path(tmp).rename(target)
        except OSError:  # another process finished first
            if not (target / "tokenizer.json").exists():
                raise
    return str(target)


@dataclasses.dataclass(frozen=True)
class Encoding:
    """How a run encodes its data: the tokenizer, the chat template (None: none), the
    ``(bos, eos)`` markers (:func:`xlafit.data.clm.special_ids`) and the inputs."""

    tok: Tokenizer
    template: rendering.ChatTemplate | None
    markers: tuple[int | None, int | None]
    inputs: list[str]


def encoding(cfg: Config) -> Encoding:
    """The run's :class:`Encoding`: ``data.tokenizer`` (else ``model.init_from_hf``'s, else the
    demo's), ``data.chat_template`` or the tokenizer's, ``data.data_dir`` (else the demo's)."""
    d = data_config(cfg)
    where = tokenizer_location(cfg)
    inputs = [d.data_dir] if d.data_dir else _demo_inputs(d.demo)
    # The template the conversations are rendered with: a family's training template in place of
    # its official one where xlafit ships one (data/templates.py); data.chat_template wins.
    template = rendering.template_for(where, d.chat_template, training=True)
    return Encoding(clm.load_tokenizer(where), template, clm.special_ids(where), inputs)


def load_data(
    cfg: Config, evaluating: bool = False, inputs: list[str] | None = None
) -> tuple[clm.PackedText, clm.PackedText]:
    """(train, eval) packed rows of the documents of ``data.data_dir`` (or the demo corpus);
    ``evaluating``: the data is read to be evaluated alone (``xlafit eval``), and said so, from
    ``inputs`` where given (:func:`scored_files`)."""
    d = data_config(cfg)
    e = encoding(cfg)
    tok, template = e.tok, e.template
    inputs = inputs or e.inputs
    train, evaluation = clm.load_packed(
        inputs,
        tok,
        seq_len=d.seq_len,
        eval_fraction=d.eval_fraction,
        seed=d.seed,
        text_column=d.text_column,
        fmt=d.format,
        template=template,
        loss_on=d.loss_on,
        markers=e.markers,
        progress=functools.partial(print, file=sys.stderr, flush=True),
        eval_inputs=[d.eval_data_dir] if d.eval_data_dir else [],
    )
    summary = data_summary(train, evaluation, d, evaluating)
    templated = train.source is not None and train.source.templated
    if templated:
        summary += f"\n  {rendering.describe(template)}"
    print(summary, flush=True, file=sys.stderr)
    fmt = train.source.format if train.source is not None else "text"
    if d.chat_template and not templated:  # said as other settings the data leaves unused are
        what = "text" if fmt == "text" else "prompt/completion text, which TRL too trains as it is"
        log.warning(
            "warning: data.chat_template=%s set, but the data is %s: no template renders it, so the setting is "
            'ignored (give conversations, {"messages": [...]} or prompt and completion as lists of messages, to '
            "train in the template)",
            d.chat_template,
            what,
        )
    if d.text_column != "text" and fmt != "text":
        log.warning("warning: data.text_column=%s set, but the records are %s: ignored", d.text_column, fmt)
    if e.markers[1] is None and fmt != "chat":  # chat: the turn's end
        log.warning(
            "warning: the tokenizer (%s) names no eos_token (in tokenizer_config.json or special_tokens_map.json), so "
            "no document or completion ends with one and the model does not learn to stop; give data.tokenizer a "
            "folder whose tokenizer_config.json names its eos_token",
            tokenizer_location(cfg),
        )
    if cfg.model.attention == "cudnn":
        check_packed_segments(train, evaluation)
    return train, (evaluation if len(evaluation) else None)  # type: ignore[return-value]


def check_packed_segments(*datasets: clm.PackedText) -> None:
    """cuDNN's packed attention takes a fixed number of segments a row
    (:func:`~xlafit.models.attention.packed_segments_limit`): refuses data that packs more."""
    for data in datasets:
        segments = data.arrays["segment_ids"]
        if not len(segments):
            continue
        most, limit = int(segments.max()), packed_segments_limit(data.seq_len)
        if most > limit:
            raise ConfigError(
                f"model.attention=cudnn takes up to {limit} documents packed in a row of {data.seq_len} tokens; "
                f"this data packs up to {most}. Use model.attention=xla (or auto), or a shorter data.seq_len."
            )


def _demo_inputs(demo: str) -> list[str]:
    records, text, _ = chat_demo.demo_files()
    if demo == "preference":
        return [chat_demo.preference_file()]
    if demo == "grpo":
        return [chat_demo.grpo_file()]
    return {"chat": [records], "arithmetic": [text]}.get(demo) or korean_demo_files()


def _many(n: int, word: str) -> str:
    """``n`` and ``word``, plural unless ``n`` is 1 ("1 row", "2 chat records")."""
    return f"{n} {word}{'' if n == 1 else 's'}"


def data_summary(train: clm.PackedText, evaluation: clm.PackedText, d: LlmDataConfig, evaluating: bool = False) -> str:
    """What the run will train on, what the loss counts, and an empty evaluation said aloud;
    ``evaluating``: ``train`` is data read to be evaluated alone (``xlafit eval``)."""
    source = train.source
    kind = "document" if source is None or source.format == "text" else f"{source.format} record"
    lines = [
        f"{'evaluation data' if evaluating else 'data'}: {_many(train.documents, kind)} -> {_many(len(train), 'row')} "
        f"of {d.seq_len} tokens ({train.tokens / max(train.arrays['input_ids'].size, 1):.1%} not padding)"
        + ("" if evaluating else f"; eval: {_many(evaluation.documents, kind)}, {_many(len(evaluation), 'row')}")
    ]
    if source is not None and source.format != "text":
        counted = "every token" if d.loss_on == "all" else f"the answers: {source.answer_share:.0%} of the tokens"
        lines.append(f"  loss on {counted} (data.loss_on={d.loss_on})")
        if source.truncated:  # in an evaluation the length is the run's: it is said, not to be changed
            fix = (
                "their ends are not scored (the run's length, which its checkpoints mean)"
                if evaluating
                else "raise data.seq_len to keep their ends"
            )
            lines.append(f"  {source.truncated} records longer than data.seq_len={d.seq_len} are cut at it; {fix}")
        if source.unanswered:  # raising data.seq_len would not keep these
            lines.append(
                f"  {source.unanswered} records have no answer (a conversation with no assistant turn): left out, as "
                "they would add nothing but a zero to the loss's mean; give them an answer, or data.loss_on=all to "
                "train on every token"
            )
        if cut := source.without_loss - source.unanswered:
            lines.append(
                f"  {cut} records have no answer token within data.seq_len={d.seq_len} (cut before their answer): "
                "left out, as they would add nothing but a zero to the loss's mean"
                + ("" if evaluating else "; raise data.seq_len to keep them")
            )
        if source.spans_boundary:
            lines.append(
                f"  {source.spans_boundary} prompt/completion records have a token across the prompt's end: their "
                "answer starts where the prompt alone and the whole encode apart (as TRL's SFTTrainer does), so the "
                "end of the prompt trains too; a prompt that ends with a newline keeps the two apart in most tokenizers"
            )
    if evaluating:
        pass
    elif source is not None and source.eval_from:
        lines.append(f"  {source.eval_from}")
    elif not len(evaluation) and d.eval_fraction > 0:
        total = train.documents + evaluation.documents
        lines.append(
            f"  no evaluation: none of the {_many(total, kind)} was drawn for it at "
            f"data.eval_fraction={d.eval_fraction} (no eval loss or perplexity will be reported); give more data or a "
            "larger data.eval_fraction, or "
            "data.eval_fraction=0 to train without one"
        )
    return "\n".join(lines)


def data_fingerprint(cfg: Config) -> dict[str, Any] | None:
    """The sha256 of each file of ``data.data_dir`` and ``data.eval_data_dir`` a run reads
    (:func:`xlafit.data.files.fingerprint`), and each of those settings that names a hub
    dataset at the commit read (:data:`~xlafit.data.files.PINNED`: what to give when the
    dataset's branch has moved on); None for the package's demo data."""
    d = data_config(cfg)
    if not d.data_dir:
        return None
    found = files.splits([d.data_dir], [d.eval_data_dir] if d.eval_data_dir else [])
    record: dict[str, Any] = files.fingerprint(found)
    named = [("data.data_dir", d.data_dir, found.train), ("data.eval_data_dir", d.eval_data_dir, found.eval)]
    pins = {key: hub.pinned(url, read[0]) for key, url, read in named if url and url.startswith("hf://") and read}
    if any(pins.values()):
        record[files.PINNED] = {key: url for key, url in pins.items() if url}
    return record


def save_artifacts(cfg: Config, run_dir: Any, train: clm.PackedText) -> None:
    """Copies the tokenizer into ``run_dir/tokenizer`` (local or a URL) with its special
    tokens (``tokenizer_config.json``, so that :func:`xlafit.data.clm.special_ids` reads
    there what the run trained with) and its chat template where it has one, for ``xlafit
    export hf`` and generation;
    keeps ``model.init_from_hf``'s ``config.json`` (:data:`BASE_CONFIG`: a full fine-tune is then
    read again without its base); records the data's format in ``run_dir/data_format.json``
    (``xlafit generate`` asks a run
    that trained on chat records through the template, any other with the text as it is), and
    for chat records the template they were rendered with. A training template that stood in
    for the tokenizer's official one (:mod:`xlafit.data.templates`) is recorded by name; the
    run's tokenizer keeps the official one, which the model is asked with.

    A chat run whose template closes the assistant's turn with another special token than the
    tokenizer's ``eos_token`` (ChatML's ``<|im_end|>`` with a tokenizer that ends documents
    with ``</s>``) records that token as its ``eos_token``, as chat models on the hub do, so
    that generation stops at the end of the turn (the tokenizer's own ``eos_token`` kept in
    ``generation_config.json``'s ``eos_token_id``, where generation stops too); not where the
    template itself renders ``eos_token``, which must stay what the run trained on.
    """
    dest = run_dir / "tokenizer"
    dest.mkdir(parents=True, exist_ok=True)
    base = model_dir(cfg)
    if base is not None and (Path(base).expanduser() / "config.json").exists():
        (run_dir / BASE_CONFIG).write_text((Path(base).expanduser() / "config.json").read_text())
    where = tokenizer_location(cfg)
    tokenizer_json = clm.tokenizer_json(where)
    (dest / "tokenizer.json").write_text(tokenizer_json)
    fmt = train.source.format if train.source is not None else "text"
    trained = rendering.template_for(where, data_config(cfg).chat_template, training=True)
    recorded: dict[str, Any] = {"format": fmt}
    if cfg.model.objective in preference.LOSSES:  # text pairs are prompt/completion records, two completions each
        recorded["records"] = "preference pairs"
    elif cfg.model.objective == "grpo":
        recorded["records"] = "prompts"
    if fmt == "chat" and trained is not None:
        recorded["chat_template"] = {
            "rendered_with": trained.name,
            "shipped": trained.shipped.name if trained.shipped is not None else None,
            "in_place_of": trained.official.name if trained.official is not None else None,
        }
    (run_dir / DATA_FORMAT_FILE).write_text(json.dumps(recorded) + "\n")
    tok = clm.load_tokenizer(where)
    source = special_tokens.settings(where)
    if source is None:  # a tokenizer.json alone: its markers, named
        bos, eos = clm.special_ids(where)
        tokens = {k: tok.id_to_token(i) for k, i in (("bos_token", bos), ("eos_token", eos)) if i is not None}
    else:
        tokens = {k: special_tokens.token_name(v) for k, v in source.items() if k.endswith("_token")}
    # The tokens that end an answer beside the eos_token: the base's (Qwen3's <|endoftext|> beside
    # <|im_end|>, Llama 3's <|eom_id|>), read by `xlafit generate` on the run as on its export.
    generation = base_generation(cfg, tokenizer_json)
    theirs = generation.get("eos_token_id")
    ends = set(theirs if isinstance(theirs, list) else [] if theirs is None else [theirs])
    # and the base's other settings (sampling, repetition penalty, answer length), which `xlafit generate`
    # takes where not given, as transformers does
    recorded = {k: v for k, v in generation.items() if k != "eos_token_id" and v is not None}
    template = trained.official if trained is not None and trained.official is not None else trained
    if template is not None:  # what the run's chat data was rendered with, for generation and export
        (dest / rendering.TEMPLATE_FILE).write_text(template.source)
        end = rendering.end_of_turn(template, tok)
        if fmt == "chat" and end is not None and "eos_token" not in template.source:
            own = clm.special_ids(where)[1]
            tokens["eos_token"] = end
            if own is not None and own != tok.token_to_id(end):  # it still ends a document: generation stops there too
                ends.add(own)
    if ends:
        recorded["eos_token_id"] = sorted(ends)
    if recorded:
        (dest / GENERATION_CONFIG).write_text(json.dumps(recorded) + "\n")
    (dest / "tokenizer_config.json").write_text(json.dumps(tokens, indent=2) + "\n")


# What a format's records are, in a line that compares two of them
FORMAT_WORDS = {"chat": "chat records", "prompt_completion": "prompt/completion records", "text": "text"}


def say_other_format(cfg: Config, path: str, read: clm.PackedText) -> None:
    """Warns where data given to score a run (``xlafit eval --data``) is of another format than
    the run trained on (:data:`DATA_FORMAT_FILE`): it is scored as what it is (text without the
    chat template, say), which is seldom what comparing with the run's own numbers means."""
    if not cfg.run.run_dir or not (recorded := as_path(cfg.run.run_dir) / DATA_FORMAT_FILE).exists():
        return
    trained = json.loads(recorded.read_text()).get("format")
    given = read.source.format if read.source is not None else "text"
    if trained in FORMAT_WORDS and given in FORMAT_WORDS and trained != given:
        log.warning(
            "warning: %s trained on %s; %s holds %s, scored as %s (the run's own numbers are of %s)",
            cfg.run.run_dir, FORMAT_WORDS[trained], path, FORMAT_WORDS[given], FORMAT_WORDS[given],
            FORMAT_WORDS[trained],
        )  # fmt: skip


def scored_files(path: str) -> list[str]:
    """What ``xlafit eval --data PATH`` scores: ``PATH``; where it is a folder whose files are
    named for splits (:func:`xlafit.data.files.splits`), its evaluation split's files
    (``validation``, else ``test``), said, as a run on that folder evaluates on them."""
    found = files.splits([path])
    if found.eval is None:
        return [path]
    names = ", ".join(name.rsplit("/", 1)[-1] for name in found.eval[:3]) + (", ..." if len(found.eval) > 3 else "")
    print(
        f"{path} is a folder of splits: scoring its evaluation split ({names}); its train files are not scored",
        file=sys.stderr,
        flush=True,
    )
    return found.eval
