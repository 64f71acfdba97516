"""Asking a trained model something: ``xlafit generate`` and :class:`Generator`.

A source is an llm run directory (its newest intact checkpoint, or ``step``, whose step is
said when loaded; a LoRA run with its adapters merged into the base it was trained on; a
run still training is read as it is then), a Hugging Face model directory, or a hub id
read into the Hugging Face cache. A chat model (its tokenizer has a chat
template) gets each prompt as a user turn with the generation prompt after it, as
``transformers``' chat pipeline does; the answer stops at the end of its turn. A run that
trained on prompt/completion records or text gets the text as it is, as it trained, unless
asked for the template (``use_chat=True``). The model runs on the run's mesh over this
host's devices (FSDP and tensor parallelism as trained).

Example:
    >>> ask = Generator.load("runs/chat-lora")                    # doctest: +SKIP
    >>> ask(["What is 3 plus 4?"], max_new_tokens=16)             # doctest: +SKIP
    ['3 plus 4 is 7.']
"""

from __future__ import annotations

import dataclasses
import json
import sys
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import yaml
from flax import nnx
from tokenizers import Tokenizer

from xlafit.config import Config
from xlafit.data import clm, rendering
from xlafit.data.chat import messages_of, template_context
from xlafit.errors import ConfigError
from xlafit.export import checkpoint_arrays, run_model
from xlafit.hf import llama as llama_hf
from xlafit.hf import peft
from xlafit.io import hub
from xlafit.io.paths import as_path, reach, reading
from xlafit.models.generation import Sampling, generate
from xlafit.models.llama import LlamaForCausalLM
from xlafit.models.lora import merge_lora
from xlafit.parallel.cluster import connect_as_run, start_backends
from xlafit.parallel.sharding import parse_rules, tree_shardings
from xlafit.recipes import config_from_dict
from xlafit.recipes.llm_data import (
    DATA_FORMAT_FILE,
    GENERATION_CONFIG,
    NOT_APPLIED,
    SAMPLING_KEYS,
    base_generation,
    data_config,
    recorded_model_dir,
)
from xlafit.train.frozen import BASE_FINGERPRINT

__all__ = ["MAX_NEW_TOKENS", "Answers", "Generator"]

MAX_NEW_TOKENS = 128  # an answer's tokens at most where neither the call nor the model's config says
PROMPT_BUCKET = 16  # prompts are padded to a power of two of tokens, this many at least (one program for many)

# a text, a conversation of {"role", "content"} turns, or a chat record: {"messages": [...]} with
# what else its template reads ("tools", "chat_template_kwargs"), as training renders it
Prompt = str | Sequence[dict[str, Any]] | dict[str, Any]


@dataclasses.dataclass
class Generator:
    """A model with its tokenizer, ready to answer prompts (see the module docstring).

    Attributes:
        model: the model (its state on this host's devices).
        tokenizer: its tokenizer.
        template: its chat template, None for a plain language model.
        eos_ids: the tokens that end an answer (the end of a turn too).
        source: where it was loaded from.
        bos_id: the token its tokenizer puts before a text (:func:`xlafit.data.clm.special_ids`):
            what a prompt asked without the chat template starts with, as in ``transformers``.
        trained_on: the format of the data a run trained on (``chat``, ``prompt_completion``,
            ``text``); None for a Hugging Face model, or a run that did not record it.
        step: the step of the run's checkpoint the model comes from (said on stderr when
            loaded); None for a Hugging Face model.
        sampling_defaults: the settings of the model's ``generation_config.json`` that
            :meth:`sampling` and a call take where not given, as ``transformers``' ``generate``
            takes them (``do_sample``, ``temperature``, ``top_k``, ``top_p``,
            ``repetition_penalty``, ``max_new_tokens``; a run's are its base's).
        trained_records: what a run's records were where its objective did not train on them as
            they are (``preference pairs``, ``prompts``); None otherwise.
    """

    model: LlamaForCausalLM
    tokenizer: Tokenizer
    template: rendering.ChatTemplate | None
    eos_ids: tuple[int, ...]
    source: str
    trained_on: str | None = None
    bos_id: int | None = None
    step: int | None = None
    sampling_defaults: dict[str, Any] = dataclasses.field(default_factory=dict)
    trained_records: str | None = None

    @property
    def chat_by_default(self) -> bool:
        """Whether a text prompt goes through the chat template unless told otherwise: a
        model with a template, unless it is a run that trained on prompt/completion records
        or text (its template came with the tokenizer; it learnt ``prompt completion</s>``)."""
        return self.template is not None and self.trained_on in (None, "chat")

    @classmethod
    def load(
        cls, source: str, step: int | None = None, revision: str | None = None, simulate: int | None = None
    ) -> Generator:
        """A run directory, a Hugging Face model directory, a PEFT adapter directory (its
        base, ``base_model_name_or_path``, with the adapter merged into it) or a hub id (see
        the module docstring); ``simulate``: this many simulated CPU devices for a run's mesh.

        Raises:
            ConfigError: not a model (no ``config.yaml`` nor ``config.json``), or not an llm run.
        """
        path = as_path(source)
        if is_run_directory(source):
            return _from_run(source, step, simulate)
        if hub.is_local(source) and not path.exists():
            raise ConfigError(
                f"{source}: no such directory; give an llm run directory, a Hugging Face model directory, or a hub "
                "id org/name."
            )
        folder = hub.resolve(source, revision, "the model")
        weights, adapter = folder, None  # a PEFT adapter's: its base's weights, the adapter merged into them
        if not (Path(folder) / "config.json").exists() and (base := peft.adapter_base(folder)) is not None:
            if not base:
                raise ConfigError(
                    f"{source} is a PEFT adapter whose adapter_config.json names no base_model_name_or_path; give "
                    "the model it was trained on there, or the merged model."
                )
            weights, adapter = hub.resolve(base, None, "the adapter's base model"), folder
            if not (Path(folder) / "tokenizer.json").exists():  # PEFT saves none: the base's
                folder = weights
        if not (Path(weights) / "config.json").exists():
            raise ConfigError(
                f"{source} is neither an llm run directory (config.yaml) nor a Hugging Face model directory "
                "(config.json); give one, or a hub id org/name."
            )
        fix = (
            f"{source} needs the tokenizer.json of the model its weights come from (save_pretrained with the "
            "tokenizer, and xlafit export hf, write it)."
        )
        tokenizer = clm.load_tokenizer(folder, fix)  # before the weights are read: it may be what is missing
        start_backends()  # as the CLI does: without libtpu's start-up errors on a host with no TPU
        model = llama_hf.from_hf(weights)
        if adapter is not None:
            model = typing.cast(LlamaForCausalLM, merge_lora(peft.load_peft_adapter(model, adapter)))
            print(f"{source}: a PEFT adapter on {base}, answering merged into it", file=sys.stderr, flush=True)
        template, stops = rendering.template_for(folder), clm.stop_ids(folder)
        bos = clm.special_ids(folder)[0]
        settings = folder
        if adapter is not None and not (Path(folder) / GENERATION_CONFIG).exists():  # PEFT writes none: the base's
            stops, settings = tuple(sorted({*stops, *clm.stop_ids(weights)})), weights
        defaults = sampling_defaults(Path(settings))
        recorded = _recorded(as_path(folder))
        return cls(
            model, tokenizer, template, stops, source, recorded.get("format"), bos, None, defaults,
            recorded.get("records"),
        )  # fmt: skip

    def encode(self, prompt: Prompt, use_chat: bool | None = None) -> list[int]:
        """A prompt's token ids: rendered as a user turn (or the conversation given) with the
        generation prompt where ``use_chat`` (default :attr:`chat_by_default`; a conversation
        always); otherwise the text after :attr:`bos_id` (the ids ``transformers``' tokenizer
        gives it, but an ``<eos>`` its tokenizer may put after a text: an answer follows). A
        conversation that ends with the assistant's turn is continued from that turn's text,
        as ``transformers``' text-generation pipeline continues it (``continue_final_message``).
        A chat record (``{"messages": [...], "tools": [...], "chat_template_kwargs": {...}}``)
        gives its template what else it reads, as training does."""
        as_chat = (self.chat_by_default or not isinstance(prompt, str)) if use_chat is None else use_chat
        if as_chat:
            if self.template is None:
                raise ConfigError(f"{self.source} has no chat template; ask without --chat.")
            context: dict[str, Any] = {}
            if isinstance(prompt, dict):  # a record: its tools and template keywords, as training passes them
                context, prompt = template_context(prompt), messages_of(prompt)
            messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
            if messages and messages[-1].get("role") == "assistant":
                text = _continued(self.template.render(messages, False, **context), messages[-1])
            else:
                text = self.template.render(messages, True, **context)
            return list(self.tokenizer.encode(text, add_special_tokens=False).ids)
        if not isinstance(prompt, str):
            raise ConfigError("a conversation needs a chat model; give the prompt as text.")
        head = [self.bos_id] if self.bos_id is not None else []
        return head + list(self.tokenizer.encode(prompt, add_special_tokens=False).ids)

    def sampling(
        self,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        repetition_penalty: float | None = None,
        seed: int | None = None,
    ) -> Sampling:
        """How to choose the tokens: what is given, the rest from the model's
        ``generation_config.json`` (:attr:`sampling_defaults`) as ``transformers``' ``generate``
        takes it, and as ``xlafit generate`` does with its flags. It samples where a
        temperature above 0, a ``top_k`` or a ``top_p`` asks to, else it is greedy (a config's
        ``do_sample`` alone is not followed); the config's ``repetition_penalty`` applies to
        greedy answers too, as in ``transformers``.

        Raises:
            ValueError: settings :class:`~xlafit.models.generation.Sampling` refuses.
        """
        d = self.sampling_defaults
        penalty = float(d.get("repetition_penalty", 1.0) if repetition_penalty is None else repetition_penalty)
        if not (temperature or top_k is not None or top_p is not None):
            return Sampling(temperature, 0, 1.0, seed, penalty)
        chosen_t = d.get("temperature") if temperature is None else temperature
        chosen_k = d.get("top_k", 0) if top_k is None else top_k
        chosen_p = d.get("top_p", 1.0) if top_p is None else top_p
        return Sampling(chosen_t, chosen_k or 0, 1.0 if chosen_p is None else chosen_p, seed, penalty)

    @property
    def max_new_tokens(self) -> int:
        """The tokens an answer has at most unless told: the model's ``generation_config.json``'s
        ``max_new_tokens``, else :data:`MAX_NEW_TOKENS`."""
        return int(self.sampling_defaults.get("max_new_tokens") or MAX_NEW_TOKENS)

    def __call__(
        self,
        prompts: Sequence[Prompt],
        max_new_tokens: int | None = None,
        sampling: Sampling | None = None,
        use_chat: bool | None = None,
        stop: Sequence[str] = (),
        stop_ids: Sequence[int] = (),
    ) -> Answers:
        """The answers to ``prompts``, one batch (see :func:`xlafit.models.generation.generate`).

        Args:
            prompts: texts, or conversations of ``{"role", "content"}`` turns.
            max_new_tokens: the tokens each answer has at most (default :attr:`max_new_tokens`).
            sampling: used as it is; None: :meth:`sampling`'s default, greedy with the model's
                ``repetition_penalty``. One that samples without a seed draws one, said in
                :attr:`Answers.seed`.
            use_chat: the chat template or not (default :attr:`chat_by_default`).
            stop: texts that end an answer: it is cut before the first one found in its
                text (the tokens after it were generated, then dropped).
            stop_ids: tokens that end an answer besides :attr:`eos_ids` (kept, as an end
                of sequence is); each row stops at its own, inside the compiled loop.

        Raises:
            ConfigError: an empty stop text, a prompt of no token, or a stop id outside the
                vocabulary.
        """
        if any(not s for s in stop):
            raise ConfigError(
                "an empty stop text would end every answer before it starts; give stop texts of 1+ characters."
            )
        ids = [self.encode(p, use_chat) for p in prompts]
        if empty := [i for i, row in enumerate(ids, 1) if not row]:
            raise ConfigError(
                f"prompt {empty[0]} is empty: no token to continue from (the tokenizer puts no BOS token before a "
                "text); give it some text, or ask in the chat template."
            )
        pad = self.tokenizer.token_to_id(clm.PAD) or 0
        stops = (*self.eos_ids, *stop_ids)
        new = self.max_new_tokens if max_new_tokens is None else max_new_tokens
        # Prompts padded to a power of two of tokens: other questions of about the same length run
        # the program compiled for the first (padding is never attended to: the same answers)
        longest, context = max(map(len, ids)), self.model.cfg.max_position_embeddings
        bucket = max(PROMPT_BUCKET, 1 << (longest - 1).bit_length())
        length = bucket if bucket + new <= context else None
        tokens = generate(self.model, ids, new, sampling or self.sampling(), stops, pad, prompt_length=length)
        answers = Answers(_cut(self.tokenizer.decode(t, skip_special_tokens=True), stop) for t in tokens)
        answers.seed = tokens.seed
        return answers


class Answers(list[str]):
    """The answers, one text per prompt (a list), and the :attr:`seed` the sampling drew them
    with (None where greedy): ``Sampling(seed=answers.seed)`` asks for the same again."""

    seed: int | None = None


def _cut(text: str, stops: Sequence[str]) -> str:
    """``text`` up to (without) the first of ``stops`` in it."""
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    return text[: min(found)] if found else text


def is_run_directory(source: str) -> bool:
    """Whether ``source`` is an xlafit run directory (it has a ``config.yaml``), local or a URL.

    Raises:
        StorageError: a URL whose storage host's name does not resolve (at once).
        ConfigError: a URL that cannot be read (the reason and the fix).
    """
    path = as_path(source)
    reach(path)
    with reading(path, name=source):
        return bool((path / "config.yaml").exists())


def _continued(rendered: str, final: dict[str, Any]) -> str:
    """``rendered`` (a conversation, no generation prompt) cut after its final message's text,
    so that the model continues that message (``transformers``' ``continue_final_message``)."""
    content = final.get("content", "")
    if isinstance(content, list):  # content parts: the last one's text
        content = content[-1].get("text", "") if content and isinstance(content[-1], dict) else ""
    for text in (content, str(content).strip()):
        if text and text in rendered:
            return rendered[: rendered.rindex(text) + len(text)]
    raise ConfigError(
        "the conversation ends with the assistant's turn, whose text the chat template does not render as it is; "
        "drop that turn to have the model answer the user's, or give the text to continue."
    )


def _from_run(source: str, step: int | None, simulate: int | None) -> Generator:
    """An llm run's model at checkpoint ``step``, placed on the run's mesh over this host's
    devices (where they do not make that mesh, replicated over them, and said)."""
    run = as_path(source)
    saved = yaml.safe_load((run / "config.yaml").read_text())
    if saved.get("recipe") != "llm":
        raise ConfigError(f"{source} is a {saved.get('recipe')!r} run; xlafit generate answers with llm runs.")
    if not (run / "tokenizer" / "tokenizer.json").exists():
        raise ConfigError(f"{source} has no tokenizer/ (a run writes it when training starts); cannot generate.")
    cfg = config_from_dict("llm", {k: v for k, v in saved.items() if k != "recipe"})
    cfg.run.run_dir = str(run)
    recorded_model_dir(cfg, source)  # the base a LoRA run's adapters apply to, found before anything starts
    rules = parse_rules(cfg.mesh.rules)
    strategy = connect_as_run(simulate, cpu=cfg.cpu, mesh=cfg.mesh.sizes, rules=rules)
    tokenizer = clm.load_tokenizer(
        run / "tokenizer", f"{source}/tokenizer/ holds the tokenizer the run's checkpoints learned; restore it."
    )
    arrays, step, metadata = checkpoint_arrays(cfg, run, step, use="generate")  # a training run's newest, as it is now
    model = run_model(cfg, arrays, metadata.get(BASE_FINGERPRINT), tokenizer.get_vocab_size(), run)
    print(f"answering from step {step} of {source}", file=sys.stderr, flush=True)  # once the base is the run's
    if cfg.lora.rank and not cfg.lora.quantized:  # a quantized base stays quantized: its adapters run beside it
        model = typing.cast(LlamaForCausalLM, merge_lora(model))
    graphdef, state = nnx.split(model)
    state = jax.device_put(state, tree_shardings(state, strategy.mesh, rules))
    template = rendering.template_for(str(run / "tokenizer"))
    model = typing.cast(LlamaForCausalLM, nnx.merge(graphdef, state))
    stops, bos = clm.stop_ids(run / "tokenizer"), clm.special_ids(run / "tokenizer")[0]
    # the settings the run recorded, over its base's as an export ships them (a run recorded before
    # the run kept all of them)
    tokenizer_json = (run / "tokenizer" / "tokenizer.json").read_text()
    defaults = sampling_defaults(run / "tokenizer", base_generation(cfg, tokenizer_json))
    recorded = _recorded(run)
    trained_on, records = _trained_on(recorded, cfg), recorded.get("records")
    return Generator(model, tokenizer, template, stops, source, trained_on, bos, step, defaults, records)


def sampling_defaults(folder: Any, under: dict[str, Any] | None = None) -> dict[str, Any]:
    """The settings of ``folder``'s ``generation_config.json`` (over ``under``: a run's base's,
    which an export ships under them) that generation takes where not given ({} where there
    are none); those it does not apply are said on stderr."""
    path = folder / GENERATION_CONFIG
    settings = {**(under or {}), **(json.loads(path.read_text()) if path.exists() else {})}
    unapplied = {k: v for k, v in settings.items() if k in NOT_APPLIED and v != NOT_APPLIED[k]}
    if unapplied:
        print(
            f"not applied: the model's {GENERATION_CONFIG} sets "
            + ", ".join(f"{k} {v}" for k, v in unapplied.items())
            + ", which xlafit's generation does not have (it takes temperature, top_k, top_p, repetition_penalty "
            "and max_new_tokens); transformers' generate on the same weights applies them",
            file=sys.stderr,
            flush=True,
        )
    return {k: settings[k] for k in SAMPLING_KEYS if settings.get(k) is not None}


def _trained_on(recorded: dict[str, Any], cfg: Config) -> str | None:
    """The format of the data a run trained on: ``recorded`` when it started (:func:`_recorded`),
    else its ``data.format`` where that names one (None: not known)."""
    if recorded.get("format") is not None:
        return str(recorded["format"])
    fmt = data_config(cfg).format
    return None if fmt == "auto" else fmt


def _recorded(folder: Any) -> dict[str, Any]:
    """What ``folder`` (a run directory, or an export of one) recorded of its data
    (:data:`~xlafit.recipes.llm_data.DATA_FORMAT_FILE`), or nothing."""
    recorded = folder / DATA_FORMAT_FILE
    return dict(json.loads(recorded.read_text())) if recorded.exists() else {}
