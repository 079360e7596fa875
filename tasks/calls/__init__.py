"""The calls room, behind every door (REST, MCP, the operator CLI, beat): the operations on a call."""
