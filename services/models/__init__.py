"""specsplit.services.models"""
