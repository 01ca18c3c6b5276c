"""The model's building blocks, one file each:
- `layernorm.py`: RMSNorm;
- `rotary_embedding.py`: RoPE, with Llama 3's long-context scaling;
- `linear.py`: how a linear layer's weight is stored and multiplied on this device.
`models/` assembles them into a model. `attention.py` is the paged attention they feed."""
