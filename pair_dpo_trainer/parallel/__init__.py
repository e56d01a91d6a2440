"""Everything that knows about ranks and shards: agreement checks, once-per-node work, collective timeouts,
ZeRO-3, FSDP2 and gathering sharded parameters.

Below the reference and the trainer, above ``modeling``: data, samplers and collators never import it (the trainer
hands them what they need, e.g. ``Node.once``).
"""
