"""A request's inputs made ready before admission: image decoding and resizing, multimodal inputs and positions, Sequences."""
