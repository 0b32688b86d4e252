"""Memory: the plan estimated before any weights load (``portarl plan``), the model's shape it
reads, activation checkpointing, and handing freed heap back to the OS."""
