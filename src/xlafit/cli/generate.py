"""``xlafit generate SOURCE --prompt TEXT``: a model's answers, from a run or a Hugging Face model."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from xlafit.cli.common import add_simulate
from xlafit.errors import ConfigError, DataError

_FORMATS = {"prompt_completion": "prompt/completion records", "text": "plain text"}  # data.format, said in words


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generate",
        help="answer prompts with an llm run's model, a Hugging Face model directory or a hub id",
        description="Greedy unless --temperature is given. A chat model (its tokenizer has a chat template) gets "
        "each prompt as a user turn, as a chat pipeline does; --no-chat gives the text as it is. A run that trained "
        "on prompt/completion records or text gets the text as it is, as it trained; --chat gives it the template. "
        "Example: xlafit generate runs/chat-lora --prompt 'What is 3 plus 4?' --max-new-tokens 32",
    )
    p.add_argument("source", metavar="SOURCE", help="an llm run directory, a Hugging Face model directory, or org/name")
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeat for a batch)")
    p.add_argument(
        "--prompts-file",
        metavar="FILE",
        help='prompts, one per line (or JSON lines: a string, {"messages": [...]} for a chat model, or '
        '{"prompt": ...} as GRPO\'s prompt records; or a Parquet file of such records)',
    )
    p.add_argument(
        "--max-new-tokens",
        type=int,
        help="tokens to generate at most (default: the model's generation_config.json's max_new_tokens, else 128)",
    )
    p.add_argument(
        "--temperature",
        type=float,
        help="sample at this temperature (0: greedy); default: greedy, or 1.0 with --top-k or --top-p",
    )
    p.add_argument(
        "--top-k",
        type=int,
        help="sample among the K likeliest tokens (0: all); without --temperature it samples at the model's "
        "temperature (its generation_config.json's, else 1.0), as transformers does when asked to sample",
    )
    p.add_argument(
        "--top-p",
        type=float,
        help="sample among the likeliest tokens summing to P (1: all). Sampling, what is not given is the model's "
        "generation_config.json's, as in transformers",
    )
    p.add_argument(
        "--repetition-penalty",
        type=float,
        help="divide the logits of the tokens an answer holds already (its prompt too) by this (1: none), greedy or "
        "sampled, as transformers does; default: the model's generation_config.json's, else 1",
    )
    p.add_argument(
        "--seed",
        type=int,
        help="the sampling's seed (0 to 2**32-1); default: a fresh one, printed so that the answers can be repeated",
    )
    p.add_argument(
        "--stop",
        action="append",
        default=[],
        metavar="TEXT",
        help="end an answer at this text, cut before it (repeat for several)",
    )
    p.add_argument(
        "--stop-id",
        action="append",
        default=[],
        type=int,
        metavar="ID",
        help="end an answer at this token id, kept as an end of sequence is (repeat for several); each prompt of "
        "the batch stops at its own",
    )
    as_chat = p.add_mutually_exclusive_group()
    as_chat.add_argument("--no-chat", action="store_true", help="give a chat model the prompt as plain text")
    as_chat.add_argument(
        "--chat",
        action="store_true",
        help="give each prompt as a user turn in the chat template, also to a run that trained on prompt/completion "
        "records or text",
    )
    p.add_argument("--step", type=int, help="a run's checkpoint (default: the newest intact one)")
    p.add_argument("--revision", help="a hub id's branch, tag or commit")
    p.add_argument("--json", action="store_true", help="print the prompts and answers (and a run's step) as JSON lines")
    add_simulate(p)
    p.set_defaults(run=run)


def _prompts(args: argparse.Namespace) -> list:
    """The prompts: each ``--prompt``, then each line of ``--prompts-file``: a JSON string, a
    JSON object's ``messages`` (a conversation) or ``prompt`` (a prompt-only record: a text
    or a conversation), or else the line as it is."""
    from xlafit.data.chat import messages_of

    prompts: list = list(args.prompt)
    if args.prompts_file:
        name = str(Path(args.prompts_file).expanduser())
        try:
            if name.endswith(".parquet"):  # records, as training reads them: one line of JSON each
                from xlafit.data.chat import read_records

                lines = [json.dumps(record) for record in read_records([name])]
            else:
                lines = open(name, encoding="utf-8").read().splitlines()
        except OSError as e:
            raise ConfigError(f"--prompts-file {args.prompts_file}: {e.strerror or e}.") from None
        except UnicodeDecodeError as e:
            raise ConfigError(
                f"--prompts-file {args.prompts_file} is not UTF-8 text (byte {e.start}); convert it with iconv first."
            ) from None
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as e:
                if line.lstrip().startswith("{"):  # a record with a typo, not a prompt (training refuses it too)
                    raise ConfigError(
                        f"--prompts-file {args.prompts_file}:{number} starts as a JSON object but is not JSON "
                        f"({e.msg}, column {e.colno}); mend it, or give that prompt as a JSON string."
                    ) from None
                item = line
            if isinstance(item, dict) and "messages" not in item and isinstance(item.get("prompt"), (str, list)):
                # a prompt-only record (TRL's layout, GRPO's data): its prompt, text or conversation
                prompts.append(item["prompt"])
                continue
            if isinstance(item, dict):
                if "messages" not in item:
                    raise ConfigError(
                        f'--prompts-file {args.prompts_file}:{number} is a JSON object without "messages" or "prompt" '
                        f'(its keys are {", ".join(item) or "none"}); give {{"messages": [...]}}, {{"prompt": ...}}, '
                        "or the prompt as plain text."
                    )
                try:
                    messages = messages_of(item)
                    context = {k: item[k] for k in ("tools", "chat_template_kwargs") if item.get(k)}
                    prompts.append({"messages": messages, **context} if context else messages)
                except DataError as e:
                    raise ConfigError(f"--prompts-file {args.prompts_file}:{number}: {e}") from None
            else:  # a JSON string is its text; any other JSON value (42, null, [1, 2]) is the line as written
                prompts.append(item if isinstance(item, str) else line)
    if not prompts and args.prompts_file:
        raise ConfigError(
            f"--prompts-file {args.prompts_file} holds no prompt (only blank lines, or none); give one prompt a line."
        )
    if not prompts:
        raise ConfigError("give a prompt: --prompt TEXT (repeat it for a batch) or --prompts-file FILE.")
    return prompts


def run(args: argparse.Namespace) -> int:
    from xlafit.generator import Generator, is_run_directory  # the library when the command runs: a fast --help
    from xlafit.models.generation import Sampling
    from xlafit.parallel.cluster import start_backends

    prompts = _prompts(args)
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens {args.max_new_tokens}: generate at least one token.")
    ranges = (  # each flag's own range first: Sampling's refusal names the values it completed them with
        ("--temperature", args.temperature, lambda v: v >= 0, "0 or more (0: greedy)"),
        ("--top-k", args.top_k, lambda v: v >= 0, "0 or more (0: every token)"),
        ("--top-p", args.top_p, lambda v: 0 < v <= 1, "above 0 and at most 1 (1: every token)"),
    )
    for flag, value, valid, wanted in ranges:
        if value is not None and not valid(value):
            raise ConfigError(f"{flag} {value}: give {wanted}.")
    try:  # the flags as given, refused before the model loads; the model's defaults join them below
        penalty = 1.0 if args.repetition_penalty is None else args.repetition_penalty
        Sampling(args.temperature, args.top_k or 0, 1.0 if args.top_p is None else args.top_p, args.seed, penalty)
    except ValueError as e:
        raise ConfigError(_in_flags(str(e))) from None
    if any(not text for text in args.stop):
        raise ConfigError("--stop '' would end every answer before it starts; give a text of 1 or more characters.")
    # A run's model starts the backends itself, with the run's CPU settings (a new model's LoRA
    # base is re-initialised, and its rounding depends on them).
    run = is_run_directory(args.source)
    if args.step is not None and not run:
        raise ConfigError(
            f"--step {args.step} picks a run's checkpoint, and {args.source} is a Hugging Face model (one set of "
            "weights): drop --step (a hub id's other revisions: --revision)."
        )
    if args.revision and run:
        raise ConfigError(
            f"--revision {args.revision} picks a hub model's revision, and {args.source} is a run directory: drop it "
            "(a run's other checkpoints: --step)."
        )
    if not args.simulate and not run:
        start_backends()
    print(f"loading {args.source} ...", file=sys.stderr, flush=True)
    ask = Generator.load(args.source, args.step, args.revision, args.simulate)
    use_chat = True if args.chat else False if args.no_chat else None
    if use_chat is None and ask.template is not None and not ask.chat_by_default:
        print(
            f"{args.source} trained on {ask.trained_records or _FORMATS.get(ask.trained_on or '', ask.trained_on)}: "
            "its prompts are given as text, as it trained, not in its tokenizer's chat template (--chat gives them "
            "in it)",
            file=sys.stderr,
        )
    sampling = _with_model_defaults(args, ask)
    if args.max_new_tokens is None and "max_new_tokens" in ask.sampling_defaults:
        print(
            f"--max-new-tokens {ask.max_new_tokens}: the model's generation_config.json's (give the flag to change it)",
            file=sys.stderr,
        )
    if sampling.samples and sampling.seed is None:  # drawn here, said before the answers: a crash still tells it
        sampling = sampling.seeded()
        print(f"seed {sampling.seed} (pass --seed {sampling.seed} to repeat)", file=sys.stderr, flush=True)
    try:
        answers = ask(prompts, args.max_new_tokens, sampling, use_chat=use_chat, stop=args.stop, stop_ids=args.stop_id)
    except ConfigError as e:  # in the command's words (max_new_tokens= -> --max-new-tokens)
        raise ConfigError(_in_flags(str(e))) from None
    for prompt, answer in zip(prompts, answers, strict=True):
        if args.json:
            step = {} if ask.step is None else {"step": ask.step}  # a run's: the checkpoint answering
            seed = {} if answers.seed is None else {"seed": answers.seed}  # what repeats a sampled answer
            print(json.dumps({"prompt": prompt, "answer": answer, **step, **seed}, ensure_ascii=False))
        else:
            shown = prompt if isinstance(prompt, str) else _shown(prompt)
            print(f"> {shown}\n{answer}\n")
    return 0


def _with_model_defaults(args: argparse.Namespace, ask: Any) -> Any:
    """The sampling of the flags, with what they leave out taken from the model's
    ``generation_config.json`` (:meth:`~xlafit.generator.Generator.sampling`, as ``transformers``'
    ``generate`` takes them), each taken one said; greedy where they do not ask, said when the
    model's config samples."""
    defaults = ask.sampling_defaults
    sampling_asked = bool(args.temperature) or args.top_k is not None or args.top_p is not None
    flags = {"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p} if sampling_asked else {}
    flags["repetition_penalty"] = args.repetition_penalty
    taken = {k: defaults[k] for k, v in flags.items() if v is None and k in defaults}
    if not sampling_asked and defaults.get("do_sample") and args.temperature is None:
        settings = ", ".join(f"{k} {v}" for k, v in defaults.items() if k in ("temperature", "top_k", "top_p"))
        print(
            f"greedy: the model's generation_config.json samples ({settings or 'at temperature 1.0'}), as "
            f"transformers' generate does by default; --temperature {defaults.get('temperature', 1.0)} samples "
            "with those settings",
            file=sys.stderr,
        )
    if taken:
        print(
            ("sampling" if sampling_asked else "greedy")
            + " with the model's generation_config.json for "
            + ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in taken.items())
            + " (give the flag to change one)",
            file=sys.stderr,
        )
    try:
        return ask.sampling(args.temperature, args.top_k, args.top_p, args.repetition_penalty, args.seed)
    except ValueError as e:
        raise ConfigError(f"{_in_flags(str(e))} (with the model's generation_config.json: {taken})") from None


def _in_flags(message: str) -> str:
    """A :class:`Sampling` refusal in the command's words (``top_k=`` -> ``--top-k``)."""
    for name in ("temperature", "top_k", "top_p", "seed", "max_new_tokens", "repetition_penalty"):
        message = message.replace(f"{name}=", f"--{name.replace('_', '-')} ").replace(
            f" {name} ", f" --{name.replace('_', '-')} "
        )
    return message


def _shown(conversation: list[dict] | dict) -> str:
    """What a conversation (or a chat record's) asks, in a line: its last user turn, and the
    assistant's text it continues where it ends with one."""
    if isinstance(conversation, dict):
        conversation = conversation["messages"]
    users = [m for m in conversation if m.get("role") == "user"]
    asked = str(users[-1].get("content", "")) if users else ""
    if conversation and conversation[-1].get("role") == "assistant":
        return f"{asked} [continuing: {conversation[-1].get('content', '')}]"
    return asked or str(conversation[-1].get("content", ""))
