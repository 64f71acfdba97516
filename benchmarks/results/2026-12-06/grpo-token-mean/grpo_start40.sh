cd /work/main
.venv/bin/xlafit train llm --simulate 8 --run-dir runs/demo-grpo-sft40 --restart \
  model.init_from_hf=runs/demo-chat-base-hf data.demo=chat data.seq_len=96 lora.rank=16 lora.alpha=32 \
  lora.targets=q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj trainer.epochs=4 optimizer.learning_rate=0.01 \
  trainer.stop_at_step=40 > /work/logs/sft40.log 2>&1
.venv/bin/xlafit export hf runs/demo-grpo-sft40 --out runs/demo-grpo-sft40-hf > /dev/null 2>&1
for seed in 0 1 2; do
  .venv/bin/xlafit train llm --simulate 1 --run-dir runs/demo-grpo40-seed$seed --restart \
    model.init_from_hf=runs/demo-grpo-sft40-hf model.objective=grpo data.demo=grpo \
    model.grpo.rewards=examples/arithmetic_rewards.py:exact_answer,right_number model.grpo.reward_weights=1,0.5 \
    model.grpo.beta=0.1 data.global_batch=128 model.grpo.num_generations=16 model.grpo.max_completion_length=16 \
    model.grpo.temperature=0.7 lora.rank=16 lora.alpha=32 lora.targets=q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj \
    trainer.epochs=30 optimizer.learning_rate=0.0014 data.seed=$seed > /work/logs/grpo40-seed$seed.train.log 2>&1
  echo seed $seed
  .venv/bin/python benchmarks/preference/grpo_arithmetic.py --start runs/demo-grpo-sft40-hf --tuned runs/demo-grpo40-seed$seed 2>&1 | tail -3
done
