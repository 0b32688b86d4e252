"""Vision-language data: the images a prompt row carries (TRL's format: ``{"type": "image"}``
placeholders in a conversation's message contents, and the images themselves in the row's
images column, ``data.image_field``). :mod:`portarl.vision.images` holds the image sources,
their load-time check and their decoding; Pillow is imported only when an image is opened
(``pip install 'portarl[vision]'``), so importing this package costs nothing."""
