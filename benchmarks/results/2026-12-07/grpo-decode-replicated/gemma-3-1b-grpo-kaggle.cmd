PYTHONPATH=src nice -n 5 /usr/bin/time -v python -m xlafit check llm --tpu kaggle --json model.preset=gemma-3-1b \
    lora.rank=16 lora.base_dtype=bfloat16 model.compute_dtype=bfloat16 model.remat=full mesh.data=1 mesh.fsdp=-1 \
    model.objective=grpo data.demo=grpo model.grpo.rewards=examples/arithmetic_rewards.py:exact_answer \
    data.global_batch=64 model.grpo.num_generations=8 model.grpo.max_completion_length=256
