"""The HTTP routes, one Blueprint per audience: OpenAI clients, operators, session owners."""
