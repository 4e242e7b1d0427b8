"""Pure cores: logic with no actor or HTTP concerns, tested directly with tables."""
