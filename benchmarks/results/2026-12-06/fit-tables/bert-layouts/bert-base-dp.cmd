xlafit check bert --tpu v5e-8 --json data.source=synthetic data.global_batch=null model.preset=base data.seq_len=128 data.per_device_batch=32
