"""nano_flashattn's performance layers: faster implementations that register at the extension points of
`dispatch.py` when imported. The registry imports each module by name (`dispatch.REGISTRY.modules`); the
paper path never does, and deleting one leaves the rest running."""
