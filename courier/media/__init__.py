"""Reading images from URLs, data: URIs and a confined directory under an address policy and size limits."""
