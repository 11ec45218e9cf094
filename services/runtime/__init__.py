"""specsplit.services.runtime"""
