xlafit check bert --tpu v4-8,v5e-8,v6e-8 --json data.source=synthetic data.global_batch=null model.preset=base data.seq_len=128 data.per_device_batch=32
