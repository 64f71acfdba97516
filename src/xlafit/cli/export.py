"""``xlafit export hf RUN_DIR --out DIR``: a run as a Hugging Face directory."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="export a run's model to another library's format")
    export_sub = p.add_subparsers(dest="export_command", required=True)
    hf = export_sub.add_parser(
        "hf",
        help="write a run as a Hugging Face directory (bert: BertForMaskedLM, resnet: ResNetForImageClassification, "
        "llm: its family's causal LM class (Llama, Qwen2, Mistral, Gemma), and a PEFT adapter for LoRA runs)",
        description="Writes config.json and model.safetensors (bert: and the tokenizer's files); load them with "
        "transformers.BertForMaskedLM.from_pretrained(DIR) and AutoTokenizer.from_pretrained(DIR), or "
        "transformers.ResNetForImageClassification.from_pretrained(DIR), or (llm) "
        "transformers.AutoModelForCausalLM.from_pretrained(DIR); a LoRA run's weights are merged, and its adapter "
        "is in DIR/adapter for peft.PeftModel.from_pretrained(base, DIR/adapter).",
    )
    hf.add_argument("run_dir", metavar="RUN_DIR", help="a run directory, local or a URL (gs://...)")
    hf.add_argument("--out", required=True, metavar="DIR", help="the Hugging Face directory to write")
    hf.add_argument("--step", type=int, help="this checkpoint instead of the newest intact one")
    hf.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    # The library when the command runs (a fast --help); export_hf starts the backends with the
    # run's CPU settings, without libtpu's start-up errors on a host that has libtpu but no TPU.
    from xlafit.export import export_hf

    done = export_hf(args.run_dir, args.out, args.step)
    if done.earlier:
        print(f"the earlier export in {done.out} was moved to {done.earlier}")
    files = ", ".join(name + (" (PEFT)" if name == "adapter/" else "") for name in done.files)
    print(f"exported checkpoint {done.step} of {args.run_dir} to {done.out}: {files}")
    return 0
