"""The models that ship with the package: the built-in LlamaGen-style policy (llama.py) and its
transformers export (llama_hf.py), Janus-Pro through transformers (janus.py), the diffusers VQ
tokenizer (tokenizer.py), peft adapters (adapters.py), and the policy kinds that load and export them (kinds.py).
This file imports nothing: each model's heavy dependencies load only when it is used."""
