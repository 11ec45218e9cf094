"""The three services (coordinator, draft, target) and what they share."""
