"""specsplit.services.kv"""
