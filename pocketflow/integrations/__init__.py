"""Integrations of pocketflow with serverless frameworks, each over pocketflow's public API only."""
