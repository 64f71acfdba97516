xlafit check llm --tpu colab model.preset=llama-3.2-1b data.seq_len=2048 data.per_device_batch=1 data.global_batch=null --json
