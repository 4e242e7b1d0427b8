"""The request bodies' JSON Schemas: the one statement of what each route accepts.

They validate every body (`validator.check`: Draft 2020-12, a compiled validator per schema, the first failure a 400
naming its `param`) and they are the request bodies of `/openapi.json` (`http/openapi.py`), so the document is the
validator's schema. The hand-written readers (`openai_requests.py`, `responses/request.py`, `anthropic/request.py`,
...) keep only what a schema cannot say: rules across fields, the server's own limits (the vocabulary, images) and the
conversion into the internal request.

Two extension keywords (OpenAPI allows `x-` keys in a schema; validators ignore them) say how a refusal is worded:

- `x-error`: the sentence that completes "'<param>' ..." for a value refused here. A failure anywhere inside the node
  is reported at the node (its path is the `param`), unless a node deeper down has its own. On a union (`oneOf`,
  `anyOf`) it words only a value that no branch takes: the branch that does take it reports its own failures; there
  `{type}` stands for the refused object's own `type`.
- `x-tag`: on a union of objects, the property whose value picks the branch (`type`); a value no branch takes is
  reported at that property (`tools[0].type`). A union without one picks by JSON type and by its branches' `const`
  properties, and a value no branch takes is reported at the union itself.
"""
