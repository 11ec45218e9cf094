"""specsplit.services.coordinator"""
