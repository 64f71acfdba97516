cd /work/main
for seed in 1 2; do
  .venv/bin/xlafit train llm --simulate 1 --run-dir runs/demo-grpo-seed$seed --restart \
    model.init_from_hf=runs/demo-grpo-sft-hf model.objective=grpo data.demo=grpo \
    model.grpo.rewards=examples/arithmetic_rewards.py:exact_answer,right_number model.grpo.reward_weights=1,0.5 \
    model.grpo.beta=0.1 data.global_batch=128 model.grpo.num_generations=16 model.grpo.max_completion_length=16 \
    model.grpo.temperature=0.7 lora.rank=16 lora.alpha=32 lora.targets=q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj \
    trainer.epochs=30 optimizer.learning_rate=0.0014 data.seed=$seed > /work/logs/grpo-seed$seed.train.log 2>&1
  .venv/bin/python benchmarks/preference/grpo_arithmetic.py --start runs/demo-grpo-sft-hf --tuned runs/demo-grpo-seed$seed 2>&1 | tail -3
done
