"""The APIs the gateway speaks, one package each: its routes, schema, conversion and responses."""
