"""Builders shared by several test files (pyproject.toml puts tests/ on sys.path)."""

import functools

import numpy as np
import optax
from flax import nnx

import xlafit
from xlafit.config import TrainerConfig
from xlafit.data import mlm, mnist
from xlafit.recipes import mnist as mnist_recipe


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
