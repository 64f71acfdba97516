"""Builders shared by several test files (pyproject.toml puts tests/ on sys.path)."""

import functools
import json
import os
import subprocess
import sys

import numpy as np
import optax
import pytest
from flax import nnx

import xlafit
from xlafit.config import TrainerConfig
from xlafit.data import mlm, mnist
from xlafit.recipes import mnist as mnist_recipe

STRESS = os.environ.get("XLAFIT_STRESS") == "1"  # the long forms too (`make test-stress`)


def xlafit_cli(*args, env=None, timeout=600, cwd=None):
    """The ``xlafit`` command as a user runs it: a fresh process, which makes its own devices
    (the suite's ``XLA_FLAGS`` dropped); ``env`` adds to the environment."""
    env = {**os.environ, **(env or {})}
    env.pop("XLA_FLAGS", None)
    return subprocess.run(
        [sys.executable, "-m", "xlafit", *args], capture_output=True, text=True, env=env, timeout=timeout, cwd=cwd
    )


def long_form(seconds: int, covered_by: str):
    """Runs the marked test under ``XLAFIT_STRESS=1`` only: ``make test`` stays within its
    25-minute budget on two cores, and ``covered_by`` (another test, in the suite) keeps what
    it proves covered there in a cheaper form."""
    reason = f"about {seconds} s: XLAFIT_STRESS=1 runs it ({covered_by} covers it in the suite's 25-minute budget)"
    return pytest.mark.skipif(not STRESS, reason=reason)


def cnn_trainer(strategy, run_dir=None, *, tx=None, epochs=2, stop_at_step=None, log_every_steps=1, **config):
    """The MNIST CNN with Adam (or ``tx``) at global batch 64 on ``strategy``."""
    return xlafit.Trainer(
        xlafit.models.MnistCNN(rngs=nnx.Rngs(params=0, dropout=1)),
        mnist_recipe.loss_fn,
        tx or optax.adam(1e-3),
        strategy=strategy,
        global_batch=64,
        config=TrainerConfig(epochs=epochs, stop_at_step=stop_at_step, log_every_steps=log_every_steps, **config),
        run_dir=run_dir,
    )


def mlm_dataset(n=400, t=64, vocab=1000, **masking):
    """Random MLM sequences of 10..t tokens; ids >= 500 are "##" pieces (whole-word masking)."""
    rng = np.random.default_rng(0)
    length = rng.integers(10, t + 1, n)
    ids = rng.integers(5, vocab, (n, t)).astype(np.int32)
    ids[:, 0] = mlm.CLS
    ids[np.arange(n), length - 1] = mlm.SEP
    ids[np.arange(t)[None] >= length[:, None]] = mlm.PAD
    continuation = np.zeros(vocab, bool)
    continuation[500:] = True  # ids >= 500 are "##" pieces
    arrays = {"input_ids": ids, "token_type_ids": np.zeros_like(ids, np.int8), "length": length.astype(np.int32)}
    return mlm.MLMDataset(arrays, vocab, mlm.MaskingConfig(**masking), continuation)


def hf_logits(directory, ids, mask, types):
    """Logits of Hugging Face's own BertForMaskedLM (PyTorch, eval mode) loaded from ``directory``."""
    import torch
    import transformers

    model = transformers.BertForMaskedLM.from_pretrained(directory).eval()
    with torch.no_grad():
        out = model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask), token_type_ids=torch.tensor(types))
    return out.logits.numpy()


LOAD_EMBEDDED = mnist.load_embedded  # the real loader, before a test replaces it


@functools.cache
def _embedded():
    return LOAD_EMBEDDED()  # parsing the CSV takes seconds: once per process


def use_few_digits(monkeypatch, train=400, test=200):
    """``mnist.load_embedded`` returns the first ``train`` and ``test`` digits of the real split,
    so a documented program runs in seconds (it shows the program runs end to end and learns)."""

    def sliced():
        data = _embedded()
        return {
            "train": {k: v[:train] for k, v in data["train"].items()},
            "test": {k: v[:test] for k, v in data["test"].items()},
        }

    monkeypatch.setattr(mnist, "load_embedded", sliced)


# --------------------------------------------------------------------------- tiny tokenizers of model families

# Each family's tokenizer laid out as its hub files are (tokenizer.json's normaliser, pre-tokenizer,
# post-processor and decoder; tokenizer_config.json, special_tokens_map.json and
# generation_config.json's special tokens and flags), with a vocabulary trained on TOKENIZER_CORPUS.
TOKENIZER_CORPUS = (
    "The capital of France is Paris. What is 3 plus 4? It is 7. You answer briefly.\n"
    "Say hi to the model. Hi, and how are you today? Rome, since 1871.\n"
)
GEMMA3_TEMPLATE = (
    "{{ bos_token }}{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{%- endif -%}"
    "{%- if message['role'] == 'assistant' -%}{%- set role = 'model' -%}{%- else -%}{%- set role = message['role'] -%}"
    "{%- endif -%}{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\n' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)
LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
CHATML_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }}[/INST]"
    "{% elif m['role'] == 'assistant' %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
)
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
_QWEN_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
TOKENIZER_FAMILIES = ("gemma3", "llama3", "qwen3", "mistral", "xlafit")


def _added(content):
    return {"content": content, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False}


def family_tokenizer(family, folder):
    """``folder`` holding a tiny tokenizer of ``family`` (one of TOKENIZER_FAMILIES; xlafit:
    :func:`xlafit.data.clm.train_bpe`'s), laid out as the family's hub files are."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    from xlafit.data import clm

    folder.mkdir(parents=True, exist_ok=True)
    if family == "xlafit":
        (folder / "corpus.txt").write_text(TOKENIZER_CORPUS * 5)
        clm.train_bpe([str(folder / "corpus.txt")], 300, folder)
        return folder
    byte_level = family in ("llama3", "qwen3")
    if family in ("gemma3", "mistral"):
        tok = Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=True, byte_fallback=True))
        tok.decoder = decoders.Sequence(
            [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
            + ([decoders.Strip(" ", 1, 0)] if family == "mistral" else [])
        )
    else:
        tok = Tokenizer(models.BPE(ignore_merges=family == "llama3"))
        tok.decoder = decoders.ByteLevel()
    if family == "gemma3":
        tok.normalizer = normalizers.Replace(" ", "▁")
        tok.pre_tokenizer = pre_tokenizers.Split(" ", "merged_with_previous")
        first, later = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"], ["<start_of_turn>", "<end_of_turn>"]
    elif family == "mistral":
        tok.pre_tokenizer = pre_tokenizers.Metaspace("▁", "first", split=False)
        first, later = ["<unk>", "<s>", "</s>"], ["[INST]", "[/INST]"]
    else:
        split = _LLAMA3_SPLIT if family == "llama3" else _QWEN_SPLIT
        if family == "qwen3":
            tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), "isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
        first = []
        later = (
            ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
            if family == "llama3"
            else ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        )
    alphabet = pre_tokenizers.ByteLevel.alphabet() if byte_level else []
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=first, initial_alphabet=alphabet, show_progress=False)
    tok.train_from_iterator([TOKENIZER_CORPUS] * 5, trainer)
    tok.add_special_tokens(later)
    ids = {t: tok.token_to_id(t) for t in first + later}
    if family == "gemma3":
        tok.post_processor = processors.TemplateProcessing(
            single="<bos> $A", pair="<bos> $A <bos>:1 $B:1", special_tokens=[("<bos>", ids["<bos>"])]
        )
        config = {"add_bos_token": True, "add_eos_token": False, "bos_token": "<bos>", "eos_token": "<eos>",
                  "pad_token": "<pad>", "unk_token": "<unk>", "mask_token": "<mask>",
                  "tokenizer_class": "GemmaTokenizer", "spaces_between_special_tokens": False,
                  "use_default_system_prompt": False, "clean_up_tokenization_spaces": False,
                  "chat_template": GEMMA3_TEMPLATE}  # fmt: skip
        generation = {"bos_token_id": ids["<bos>"], "eos_token_id": [ids["<eos>"], ids["<end_of_turn>"]],
                      "pad_token_id": ids["<pad>"]}  # fmt: skip
    elif family == "mistral":
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s>:1 $B:1", special_tokens=[("<s>", ids["<s>"])]
        )
        config = {"add_bos_token": True, "add_eos_token": False, "bos_token": "<s>", "eos_token": "</s>",
                  "unk_token": "<unk>", "pad_token": None, "legacy": False, "tokenizer_class": "LlamaTokenizer",
                  "spaces_between_special_tokens": False, "use_default_system_prompt": False,
                  "chat_template": MISTRAL_TEMPLATE}  # fmt: skip
        generation = {"bos_token_id": ids["<s>"], "eos_token_id": ids["</s>"]}
    elif family == "llama3":
        tok.post_processor = processors.Sequence(
            [
                processors.ByteLevel(add_prefix_space=True, trim_offsets=False, use_regex=True),
                processors.TemplateProcessing(
                    single="<|begin_of_text|> $A",
                    pair="<|begin_of_text|> $A <|begin_of_text|>:1 $B:1",
                    special_tokens=[("<|begin_of_text|>", ids["<|begin_of_text|>"])],
                ),
            ]
        )
        config = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "clean_up_tokenization_spaces": True,
                  "model_input_names": ["input_ids", "attention_mask"], "tokenizer_class": "PreTrainedTokenizerFast",
                  "chat_template": LLAMA3_TEMPLATE}  # fmt: skip
        generation = {"bos_token_id": ids["<|begin_of_text|>"],
                      "eos_token_id": [ids["<|end_of_text|>"], ids["<|eot_id|>"]]}  # fmt: skip
    else:
        tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
        config = {"add_prefix_space": False, "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
                  "unk_token": None, "errors": "replace", "split_special_tokens": False,
                  "tokenizer_class": "Qwen2Tokenizer", "clean_up_tokenization_spaces": False,
                  "chat_template": CHATML_TEMPLATE}  # fmt: skip
        generation = {"bos_token_id": ids["<|endoftext|>"], "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]]}
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    named = {k: _added(v) for k, v in config.items() if k.endswith("_token") and isinstance(v, str)}
    (folder / "special_tokens_map.json").write_text(json.dumps(named, indent=2))
    (folder / "generation_config.json").write_text(json.dumps(generation, indent=2))
    return folder


def write_mnist_idx(directory, train=512, test=128):
    """The first ``train`` training and ``test`` test digits of the embedded MNIST as IDX files
    in ``directory`` (quick to load in a subprocess); returns ``directory``."""
    raw = mnist.load_embedded()
    for split, prefix, n in (("train", "train", train), ("test", "t10k", test)):
        images = np.round((raw[split]["image"][:n, :, :, 0] * mnist.STD + mnist.MEAN) * 255).astype(np.uint8)
        mnist.write_idx(directory / f"{prefix}-images-idx3-ubyte", images)
        mnist.write_idx(directory / f"{prefix}-labels-idx1-ubyte", raw[split]["label"][:n].astype(np.uint8))
    return directory


# A preset's vocabulary, one small layer, a short sequence, the logits whole: the shapes of a
# named model, cheap to compile for a TPU (the eval-step fit tests of check and plan).
SMALL_LLM = [
    "model.preset=llama-3.2-1b", "model.num_layers=1", "model.hidden_size=128", "model.intermediate_size=256",
    "model.num_heads=2", "model.num_kv_heads=1", "model.logits_chunk=0", "data.seq_len=64",
    "data.per_device_batch=1", "data.global_batch=null",
]  # fmt: skip


def mnist_train_cmd(run_dir, idx_dir, *extra, epochs=4, checkpoint_every=1):
    """``xlafit train mnist`` on one simulated device over :func:`write_mnist_idx`'s digits,
    logging every step, as a subprocess's command line."""
    return [
        sys.executable, "-m", "xlafit",
        *("train", "mnist", "--simulate", "1", "--data-dir", str(idx_dir), "--run-dir", str(run_dir)),
        *("data.global_batch=64", "data.eval_global_batch=128", "trainer.invariant_chunks=null"),
        *(f"trainer.epochs={epochs}", "trainer.log_every_steps=1"),
        f"trainer.checkpoint_every_steps={checkpoint_every}",
        *extra,
    ]  # fmt: skip


def user_env():
    """This process's environment without the suite's simulated devices (``XLA_FLAGS``), with
    unbuffered output: what a subprocess a user starts has."""
    return {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | {"PYTHONUNBUFFERED": "1"}


def recomputed(model, prompt, n):
    """Greedy tokens by running the whole sequence through the model at every step: the
    reference a KV cache must equal. The sequence is padded to its final length, so the
    forward compiles once (a causal model's logits at a position do not see the padding after
    it); op by op, each new length made this loop a minute or more of a test."""
    import jax.numpy as jnp

    width = len(prompt) + n
    forward = nnx.jit(lambda m, ids: m(ids))
    seq = list(prompt)
    for _ in range(n):
        padded = jnp.array([seq + [0] * (width - len(seq))])
        seq.append(int(jnp.argmax(forward(model, padded)[0, len(seq) - 1])))
    return seq[len(prompt) :]


def peft_tuned(ours, folder, out, **from_pretrained):
    """``ours`` (LoRA applied) with every ``lora_b`` set to 0.05, so that its adapter changes
    the logits, saved as a PEFT adapter in ``out`` and applied by PEFT to transformers' model
    of ``folder``: returns that PEFT model (eval mode) and the adapter's written targets."""
    import jax.numpy as jnp
    import peft
    import transformers

    from xlafit.hf.peft import save_peft_adapter

    for path, value in nnx.state(ours, nnx.LoRAParam).flat_state():
        if path[-1] == "lora_b":
            value.set_value(jnp.full(value.shape, 0.05, value.dtype))
    save_peft_adapter(ours, out, base_model_name_or_path=str(folder))
    written = json.loads((out / "adapter_config.json").read_text())["target_modules"]
    base = transformers.AutoModelForCausalLM.from_pretrained(str(folder), **from_pretrained)
    return peft.PeftModel.from_pretrained(base, str(out)).eval(), written


def packed_rows(n: int, t: int, vocab: int, seed: int = 0) -> dict[str, np.ndarray]:
    """``n`` packed rows of ``t`` tokens below ``vocab``: two documents a row, then padding
    (segment 0, token 0)."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, vocab, (n, t)).astype(np.int32)
    segments, positions = np.zeros((n, t), np.int32), np.zeros((n, t), np.int32)
    for r in range(n):
        a, b = rng.integers(3, 8), rng.integers(3, 7)
        segments[r, :a], segments[r, a : a + b] = 1, 2
        positions[r, :a], positions[r, a : a + b] = np.arange(a), np.arange(b)
    ids[segments == 0] = 0
    return {"input_ids": ids, "segment_ids": segments, "positions": positions}


def hf_greedy(theirs, prompts, new_tokens, **generate):
    """transformers' greedy ``generate`` of ``new_tokens`` after each prompt (left-padded with
    token 0 under an attention mask): the new tokens, a list per prompt."""
    import torch

    length = max(map(len, prompts))
    ids = torch.tensor([[0] * (length - len(p)) + list(p) for p in prompts])
    mask = torch.tensor([[0] * (length - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = theirs.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0, **generate
        )
    return out[:, length:].tolist()


# NF4's 16 levels (Dettmers et al. 2023, appendix E), written out here rather than read from Qwix.
NF4 = np.array(
    [
        -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
        -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
        0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
        0.7229568362236023, 1.0,
    ]
)  # fmt: skip


def block_parameters(ours, theirs_class, theirs_config, layers=4):
    """(xlafit's, transformers') parameter counts of the first ``layers`` layers of a preset
    ``ours`` with its embeddings and output layer, transformers' built from ``theirs_config``
    (a config object) on the meta device: nothing is allocated."""
    import dataclasses

    import torch

    from xlafit.models.llama import LlamaForCausalLM

    block = dataclasses.replace(ours, num_layers=layers, layer_types=ours.layer_types[:layers])
    with torch.device("meta"):
        small = type(theirs_config)(**{**theirs_config.to_dict(), "num_hidden_layers": layers, "layer_types": None})
        theirs = sum(p.numel() for p in theirs_class(small).parameters())
    shapes = nnx.eval_shape(lambda: LlamaForCausalLM(block, rngs=nnx.Rngs(0)))
    return sum(v.size for _, v in nnx.to_flat_state(nnx.state(shapes, nnx.Param))), theirs
