"""The ground every layer stands on: errors, settings and their sections, the hardware, the byte
tokenizer, reports, and the mesh's logical axes."""
