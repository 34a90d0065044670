"""flowertune-lora: federated LoRA fine-tuning of a causal language model, FlowerTune-style."""
