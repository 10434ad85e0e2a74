"""Schemas for every record that crosses an actor boundary or a file. Only pydantic and the stdlib here."""
