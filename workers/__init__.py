"""Worker roles: the host agent and the model processes it spawns (where llama.cpp runs)."""
