"""Reading images from URLs, data: URIs and a confined directory: URL rules, an address policy, size limits and a
memory budget for decoded pixels."""
