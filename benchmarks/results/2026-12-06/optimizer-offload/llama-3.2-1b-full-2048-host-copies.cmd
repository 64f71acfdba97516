# the lever's program compiled alone and priced by the step model, kernel by kernel (from the repository root)
PYTHONPATH=src python - <<'PY'
from xlafit.check.recipes import recipe_program
from xlafit.check.tpu import Steps, memory_of
from xlafit.platform import hardware as tpu
from xlafit.predict.model import predict
from xlafit.predict.rates import BUILT_IN, load_rates
o = ["model.preset=llama-3.2-1b", "data.seq_len=2048", "data.per_device_batch=1", "data.global_batch=null",
     "model.remat=full", "trainer.optimizer_offload=true"]
program, _, _ = recipe_program("llm", o)
steps = Steps(tpu.parse_target("colab"), program)
compiled, seconds = steps.compile_train(1)
(rates,) = [r for r in load_rates(BUILT_IN) if r.device_kind == "TPU v5 lite"]
p = predict(compiled.as_text(), rates)
host = [t for t in p.kernels if t.bound == "host"]
print(memory_of(compiled, steps.state_bytes, 0), p.seconds, p.exposed_collective_s,
      sum(t.kernel.bytes for t in host), sum(t.seconds for t in host))
PY
