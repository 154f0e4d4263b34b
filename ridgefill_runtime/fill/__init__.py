"""RidgeFill: fit the late-layer maps, store them, and fill the prefix's late K/V from them."""
