"""The reliability bench (`python -m bench.reliability`): one module per part, `common` for what they share."""
