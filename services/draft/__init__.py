"""specsplit.services.draft"""
