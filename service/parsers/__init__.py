"""Parsers of model text for the OpenAI API: tool calls (`tool_calls`) in each model
family's own syntax."""
