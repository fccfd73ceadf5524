"""JSON Schemas shipped with the image builder (package data; read with :mod:`importlib.resources`)."""
